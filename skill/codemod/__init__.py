"""Source edits for the porting engine.

Every change to an existing file goes through libcst (``cst``), on one parse of the file
(``document.Document``) that its edits rebuild and that is printed once, so comments,
formatting and hand edits survive; and every set of writes goes through a transaction
(``workspace``), so a failure or Ctrl-C leaves the tree as it was.
"""

from skill.codemod.format import FormatError, format_python
from skill.codemod.names import ModelNames, validate_model_name
from skill.codemod.workspace import StagedTree, Workspace, WorkspaceError, transaction

__all__ = [
    "FormatError",
    "ModelNames",
    "StagedTree",
    "Workspace",
    "WorkspaceError",
    "format_python",
    "transaction",
    "validate_model_name",
]
