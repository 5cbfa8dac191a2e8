"""Step 1 of the porting playbook: analyse a HuggingFace decoder-only family.

``analyze_hf_model(AnalyzeInput) -> ArchitectureReport``; the modules split the work by
concern: ``inputs`` (resolving and refusing sources), ``modules`` (the module tree),
``probes`` (numerical probes), ``source_scan`` (libcst), ``detect`` (the checklist),
``config_fields``, ``reference`` (nearest reference, deltas) and ``report`` (models).

The names below are imported on first use (PEP 562): a stage run or a TP-plan trace that
needs only ``modules`` or ``probes`` does not import the checklist and the code it reads
(about 0.5 s of every such child process, measured on the 2-core machine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skill.analysis.analyze import analyze_hf_model
    from skill.analysis.inputs import AnalysisError, decoder_only_candidates
    from skill.analysis.report import AnalyzeInput, ArchitectureReport

_HOMES = {
    "analyze_hf_model": "skill.analysis.analyze",
    "AnalysisError": "skill.analysis.inputs",
    "decoder_only_candidates": "skill.analysis.inputs",
    "AnalyzeInput": "skill.analysis.report",
    "ArchitectureReport": "skill.analysis.report",
}

__all__ = ["AnalysisError", "AnalyzeInput", "ArchitectureReport", "analyze_hf_model", "decoder_only_candidates"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
