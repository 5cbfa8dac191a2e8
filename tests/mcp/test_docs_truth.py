"""SKILL.md and README say what the code does where they name tools, commands, stages and
steps (issue 20, item 5): an agent that reads only them must not be misled."""

from __future__ import annotations

import ast
import re

import pytest

from skill.analysis.reference import reference_for
from skill.cli import build_parser, sub_commands
from skill.harness.distributed import LABELS, PARALLELISMS
from skill.harness.results import STAGE_NAMES
from skill.porting.copy_reference import CopyReferenceRequest
from skill.porting.plan import ALLOW_UNSUPPORTED_STEPS, unsupported_error
from skill.porting.provenance import SESSIONS_DIR
from skill.tools import load_tools
from tests.mcp.conftest import REPO
from tests.mcp.scripted_client import SESSIONS, _section, read_playbook

SKILL_MD = (REPO / "SKILL.md").read_text(encoding="utf-8")
README = (REPO / "README.md").read_text(encoding="utf-8")
CI_RUN = (REPO / ".ci" / "run").read_text(encoding="utf-8")
# Tool-shaped names: the verbs the engine's steps start with.
_TOOL_NAME = re.compile(r"`((?:analyze|copy|edit|set|write|register|check|run|port|locate|export)_[a-z_]+)`")
_NUMBERS = {"nine": 9, "ten": 10, "eleven": 11}


def _engine_tools() -> set[str]:
    return {name for name in load_tools() if not name.startswith("toy_")}


def test_every_tool_the_docs_name_is_registered_and_skill_md_names_every_tool():
    tools = _engine_tools()
    for doc, text in (("SKILL.md", SKILL_MD), ("README.md", README)):
        named = set(_TOOL_NAME.findall(text))
        assert named <= tools, f"{doc} names tools the MCP server lacks: {sorted(named - tools)}"
    assert tools <= set(_TOOL_NAME.findall(SKILL_MD)), (
        f"SKILL.md never names {sorted(tools - set(_TOOL_NAME.findall(SKILL_MD)))}"
    )


def test_every_cli_command_the_docs_name_exists():
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]
    commands = set(subparsers.choices)
    for doc, text in (("SKILL.md", SKILL_MD), ("README.md", README)):
        # In code: a command line of a code block, or inline code.
        named = set(re.findall(r"(?:^|`)archon-port ([a-z][a-z-]*)\b", text, re.MULTILINE))
        assert named, doc
        assert named <= commands, f"{doc} names CLI commands that do not exist: {sorted(named - commands)}"


def test_the_step_count_is_the_playbook_s():
    body = _section(SKILL_MD, "Step by step")
    headings = [int(n) for n in re.findall(r"^### Step (\d+):", body, re.MULTILINE)]
    assert headings == list(range(1, len(headings) + 1))
    steps = read_playbook(SKILL_MD).steps
    assert len(steps) == len(headings) and steps[-1].tool == "run_test_stage"
    intro = re.search(r"A port is (\w+) steps: (\w+) tool\s+calls", SKILL_MD)
    assert intro, "SKILL.md's introduction states the number of steps"
    assert (_NUMBERS[intro[1]], _NUMBERS[intro[2]]) == (len(headings), len(headings) - 1)


def _stage_rows(text: str) -> dict[int, str]:
    rows = re.findall(r"^\| (\d) (\w+) +\|(?: `stage\d` \|)? (.+?) \|$", text, re.MULTILINE)
    return {int(n): f"{name}: {what}" for n, name, what in rows}


@pytest.mark.parametrize("doc", ["SKILL.md", "README.md"])
def test_the_stage_tables_list_the_harness_stages_and_every_parallelism(doc: str):
    rows = _stage_rows(SKILL_MD if doc == "SKILL.md" else README)
    assert sorted(rows) == sorted(STAGE_NAMES)
    for number, name in STAGE_NAMES.items():
        assert rows[number].startswith(f"{name}:"), (doc, rows[number])
    distributed = rows[5]
    for parallelism in PARALLELISMS:
        times = "\u00d7"  # the multiplication sign the tables write
        words = {"ep_tp": f"EP{times}TP|EP=2{times}TP=2"}.get(parallelism, LABELS[parallelism].split("=")[0].upper())
        assert re.search(words, distributed), f"{doc}'s stage 5 row omits {parallelism}: {distributed}"


def test_allow_unsupported_is_named_for_exactly_the_tools_that_take_it():
    takes_it = sorted(n for n, t in load_tools().items() if "allow_unsupported" in t.input_model.model_fields)
    assert sorted(ALLOW_UNSUPPORTED_STEPS) == takes_it
    hand = _section(SKILL_MD, "Porting by hand")
    sentence = hand[hand.index('`"allow_unsupported": true` added to the calls of') :].split(";")[0]
    assert sorted(re.findall(r"`([a-z_]+)`", sentence)) == takes_it
    # port_model's refusal names every one of them, as does each tool's own.
    refusal = str(unsupported_error("x", ["unsupported: y"], "port_model"))
    assert all(name in refusal for name in takes_it), refusal
    assert "allow_unsupported=true to edit_args" in str(unsupported_error("x", ["unsupported: y"], "edit_args"))


def test_the_reference_rule_is_the_code_s():
    rule = _section(SKILL_MD, "Step by step")
    rule = rule[rule.index("`<reference>` is the reference the analysis selected") :].split("\n\n")[0]
    assert "`deepseek_v3` for multi-head latent attention" in rule and "`qwen3` for MoE" in rule
    assert "per-head QK norm or MoE" not in rule
    assert "`qwen3_5` for Gated DeltaNet layers beside attention" in rule
    assert reference_for(per_head_qk_norm=True, moe=False, hybrid=True) == "qwen3_5"
    assert reference_for(per_head_qk_norm=False, moe=False, mla=True) == "deepseek_v3"
    assert reference_for(per_head_qk_norm=True, moe=True) == "qwen3"
    assert reference_for(per_head_qk_norm=False, moe=True) == "qwen3"
    # The rule the first SKILL.md stated: per-head QK norm alone does not pick qwen3.
    assert reference_for(per_head_qk_norm=True, moe=False) == "qwen2" and "starts from `qwen2` too" in rule


def test_copy_reference_s_own_description_states_the_same_rule():
    """The argument's description is what `copy-reference --help` and the MCP tool schema show."""
    described = CopyReferenceRequest.model_fields["reference"].description or ""
    assert "'qwen3' (MoE)" in described and "QK norm" not in described.split("'qwen3'")[1]
    assert "'qwen2' (dense" in described and "'deepseek_v3' (MLA)" in described
    assert "'qwen3_5' (Gated DeltaNet layers beside attention" in described


def test_skill_md_says_where_a_session_is_committed():
    committed = f"{SESSIONS.relative_to(REPO).as_posix()}/<model_name>.jsonl"
    assert SESSIONS.relative_to(REPO).as_posix() == SESSIONS_DIR
    assert committed in _section(SKILL_MD, "Porting by hand") and committed in _section(SKILL_MD, "Sessions")


def test_the_readme_says_what_ci_run_runs():
    sentence = " ".join(README[README.index("Run the tests (`.ci/run`") :].split("```")[0].split())
    assert "runs exactly" not in sentence
    commands = [line for line in CI_RUN.splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    expected = {
        "pip install": "installs",
        "bash .ci/lint": ".ci/lint",
        ".venv-areal-torch210": "AReaL-pins run",
        "python -m skill.areal.environment .venv-areal": ".venv-areal/",
        "-m regenerate": "drift check",
        "-m replay": "session replays",
        "-m every_family": "the AReaL tier of every other family and the other composition and fuzzer-found",
        "python -m pytest -n 2": "runs this",
        ".venv-tf53": "oldest- and newest-transformers runs",
        ".venv-tf-newest": "oldest- and newest-transformers runs",
    }
    for command in commands:
        key = next((k for k in expected if command.startswith(k) or k in command), None)
        assert key is not None, f".ci/run runs {command!r}, which the README does not say"
        assert expected[key] in sentence, (command, sentence)


def test_a_failed_stage_or_port_is_a_result_and_the_docs_say_what_to_read():
    """Issue 20, item 6: a stage that ran and failed is the tool's answer (isError false, the
    result typed by its output schema); isError is for a call that could not run."""
    tools = load_tools()
    for name in ("run_test_stage", "port_model"):
        description = tools[name].description
        assert "isError false" in description and "`passed`" in description, description
        assert "passed" in tools[name].result_model.model_fields
        assert "the field to read" in (tools[name].result_model.model_fields["passed"].description or "")
    rules = _section(SKILL_MD, "Ground rules")
    assert "`isError: false`" in rules and "`structuredContent.passed`" in rules
    for name in ("run_test_stage", "port_model", "check_package", "export_to_areal"):
        assert f"`{name}`" in rules[rules.index("is a result, not an error") :][:400], name


def test_ci_runs_the_newest_transformers_the_engine_names():
    """Issue 19, item 5: CI proves the newest transformers, the one environment.py names."""
    from skill.areal.environment import NEWEST_TF_VENV_DIR, NEWEST_TRANSFORMERS

    setup = f"python -m skill.areal.environment {NEWEST_TF_VENV_DIR} --no-areal --transformers {NEWEST_TRANSFORMERS}"
    assert setup in CI_RUN and setup in README
    assert f"{NEWEST_TF_VENV_DIR}/bin/python -m pytest tests/archon" in CI_RUN


def test_the_tp_example_for_a_norm_over_a_sharded_width_is_bitnet_s_own_plan():
    """SKILL.md's example of the TP entries a norm over a sharded width needs (issue 20) is the
    plan the sub-norm edits write for bitnet and stage 5 proves, entry for entry."""
    hand = SKILL_MD[SKILL_MD.index("## Porting by hand") :]
    example = hand[hand.index("A norm over a") :]
    code = example[example.index("```python") + len("```python") : example.index("```", example.index("```python") + 9)]
    plan = (REPO / "archon_models" / "bitnet" / "infra" / "parallelize.py").read_text(encoding="utf-8")

    def entries(tree: ast.AST) -> dict[str, str]:
        return {
            key.value: ast.unparse(value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Dict)
            for key, value in zip(node.keys, node.values, strict=True)
            if isinstance(key, ast.Constant)
        }

    shown = entries(ast.parse("{" + code + "}"))
    assert sorted(shown) == ["attention.sub_norm", "attention.wo"]
    written = entries(ast.parse(plan))
    assert {key: written.get(key) for key in shown} == shown


def test_the_docs_say_how_to_run_a_family_s_stage_5_and_areal_tier():
    """Agent20c's friction 9: `pytest tests/areal -k axk1` selected nothing (the default `-m`
    deselects every_family) and the family's stage 5 was left out silently; the docs name the
    marker a porter adds, and the facts they state about it are the suite's."""
    import tomllib

    from tests.archon import conftest as archon_conftest

    marker = archon_conftest.EVERY_FAMILY_MARKER
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert f"not {marker}" in addopts["addopts"]
    assert "DEFAULT_RUN_FAMILIES" in vars(archon_conftest)
    prove = _section(SKILL_MD, "Porting by hand")
    prove = prove[prove.index("4. **Prove it.**") : prove.index("5. **When a stage fails**")]
    command = f"python -m pytest tests/archon/test_<model_name>.py tests/areal -k <model_name> -m {marker}"
    assert command in " ".join(prove.split())
    assert "`DEFAULT_RUN_FAMILIES`" in prove and "`tests/archon/conftest.py`" in prove
    readme = " ".join(README.split())
    assert f"python -m pytest tests/archon/test_<family>.py tests/areal -k <family> -m {marker}" in readme


def test_skill_md_says_closing_a_session_is_final_with_the_code_s_refusal(tmp_path):
    """Agent20c's friction 8: a hand edit found after `replay --close` could not enter the session;
    step 8 says so before the close, quoting the refusal the recorder gives, and says to check a
    real checkpoint's extra keys first."""
    from skill.session import SessionRecorder, open_records

    (tmp_path / "archon_models").mkdir()
    session = tmp_path / "s.jsonl"
    SessionRecorder(session, tmp_path).close()
    with pytest.raises(ValueError, match="closed") as refused:
        open_records(session)
    quoted = str(refused.value).replace(str(session), "...")
    commit = _section(SKILL_MD, "Porting by hand")
    commit = " ".join(commit[commit.index("8. **Commit the session**") :].split())
    assert "**Closing is final.**" in commit and f"(`{quoted}`)" in commit
    assert "`replay --rerecord`" in commit and "new session" in commit
    assert "`_keys_to_ignore_on_load_unexpected`" in commit
    assert commit.index("check what a real checkpoint") < commit.index("before the close")


def test_edit_model_lists_every_edit_from_the_registry_and_skill_md_says_when_to_pass_edits():
    """Agent20d's friction 3: `--edits` was named nowhere in SKILL.md and no face listed the edit
    names (found only in xglm's header). The tool's `edits` field, which the MCP schema and
    `edit-model --help` both show, lists every edit of the registry with what it writes; SKILL.md's
    hand port says when to pass it, and every name its example passes is an edit."""
    from skill.porting.model_edits import MODEL_EDITS

    schema = load_tools()["edit_model"].input_model.model_json_schema()
    described = schema["properties"]["edits"]["description"]
    commands = sub_commands(build_parser())
    commands.populate("edit-model")
    shown = "".join(commands.choices["edit-model"].format_help().split())  # argparse wraps at hyphens
    for edit in MODEL_EDITS:
        assert f"{edit.name}: {edit.description}" in described, edit.name
        assert "".join(f"{edit.name}: {edit.description}".split()) in shown, edit.name
    hand = " ".join(_section(SKILL_MD, "Porting by hand").split())
    assert "`--edits NAME`" in hand and "`archon-port edit-model --help`" in hand
    example = re.search(r'`"edits": \[([^\]]*)\]`', hand)
    assert example, "the hand port shows an `edits` call"
    from skill.porting.applied_edits import GENERATED

    assert f"(`{GENERATED} ... with edits: ...`)" in hand
    passed = re.findall(r'"([a-z_]+)"', example[1])
    assert passed and set(passed) <= {edit.name for edit in MODEL_EDITS}, passed


def test_skill_md_says_what_an_absent_hand_edit_places_means_as_the_report_serialises_it():
    """Agent20d's friction 8: SKILL.md said to read `hand_edit_places`, which ctrl's analysis left
    out; the section says when the field is absent and where such a feature's marker goes, and the
    report does leave an empty map out."""
    from skill.analysis.report import ArchitectureReport
    from skill.porting.edit_model import marker_place

    field = ArchitectureReport.model_fields["hand_edit_places"]
    assert field.exclude_if is not None and field.exclude_if({}) and not field.exclude_if({"x": object()})
    hand = " ".join(_section(SKILL_MD, "Porting by hand").split())
    assert "left out of the analysis result" in hand and "absent, not an empty map" in hand
    assert "(`embedding` or `position`: the model's `forward`, above the embedding;" in hand
    assert "`norm`: `TransformerBlock.forward`;" in hand and "no such word: `TransformerBlock.forward`)" in hand
    assert marker_place("embeddings scaled").where("M") == "M.forward"
    assert marker_place("embeddings scaled").anchor == "self.tok_embeddings(tokens)"
    assert marker_place("position encoding = none").where("M") == "M.forward"
    assert marker_place("sandwich norm of another kind").where("M") == "TransformerBlock.forward"
    assert marker_place("something else").where("M") == "TransformerBlock.forward"


def _collected(*commands: list[str]) -> list[list[str]]:
    """The test ids ``python -m pytest --collect-only`` selects with each of ``commands``' arguments.

    One interpreter runs the collections one after the other (``pytest.main`` per command, as
    ``python -m pytest`` runs it): each start imports torch, transformers and the engine, 6-10 s
    on the 2-core machine."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys, pytest\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    code = pytest.main(['-p', 'no:cacheprovider', '--collect-only', '-q', *args])\n"
        "    print(sys.argv[2], int(code), flush=True)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(commands), _SEPARATOR],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    selected: list[list[str]] = [[]]
    for line in run.stdout.splitlines():
        if line.startswith(_SEPARATOR):
            code = int(line.removeprefix(_SEPARATOR))
            assert code in (0, 5), run.stdout + run.stderr  # 5: nothing collected
            selected.append([])
        elif "::" in line:
            selected[-1].append(line)
    assert len(selected) == len(commands) + 1 and not selected[-1], run.stdout + run.stderr
    return selected[:-1]


_SEPARATOR = "=== end of one collection, exit"


@pytest.mark.slow
def test_the_docs_commands_for_one_family_s_replay_and_regeneration_select_what_they_say():
    """Agent20d's friction 9 and 10: no document named the command replaying ONE family's session
    (found through --collect-only), nor that `-m regenerate -k <family>` selects nothing for a hand
    port; and the README named one committed hand port though there are several. The commands the
    docs give select, for a committed hand port, its replay and no regeneration."""
    from skill.codemod.workspace import Workspace
    from skill.porting.provenance import HAND_WRITTEN
    from skill.porting.regenerate import committed_regenerations
    from tests.mcp.test_e2e import REPRESENTATIVE
    from tests.skill.test_regenerate import REPRESENTATIVE as REGENERATED_BY_DEFAULT

    replay = "python -m pytest tests/mcp/test_e2e.py -m replay -k <{}>"
    regenerate = "python -m pytest tests/skill/test_regenerate.py -m regenerate -k <{}>"
    skill_md, readme = " ".join(SKILL_MD.split()), " ".join(README.split())
    assert replay.format("model_name") in skill_md and regenerate.format("model_name") in skill_md
    assert replay.format("family") in readme and "-m regenerate -k <family>" in readme
    assert "`REPRESENTATIVE`" in skill_md and "`REPRESENTATIVE`" in readme
    assert "is the committed hand port" not in readme
    assert f"`{HAND_WRITTEN}`" in readme
    assert '"hand-edited (replayed instead)"' in readme

    generated, hand_ports = committed_regenerations(Workspace(REPO))
    # A hand port if one is committed (its regeneration selects nothing), else a generated family
    # (its regeneration selects exactly it): either way the -k filter picks one family's test.
    sessions = REPO / "tests" / "mcp" / "sessions"
    pool = sorted(hand_ports) or sorted(
        r.model_name for r in generated if (sessions / f"{r.model_name}.jsonl").is_file()
    )
    family = next(name for name in pool if name not in REPRESENTATIVE and name not in REGENERATED_BY_DEFAULT)
    replayed, regenerated = _collected(
        ["tests/mcp/test_e2e.py", "-m", "replay", "-k", family],
        ["tests/skill/test_regenerate.py", "-m", "regenerate", "-k", family],
    )
    assert replayed == [f"tests/mcp/test_e2e.py::test_committed_sessions_replay[{family}]"]
    assert regenerated == (
        []
        if hand_ports
        else [f"tests/skill/test_regenerate.py::test_every_committed_package_regenerates_byte_for_byte[{family}]"]
    )
