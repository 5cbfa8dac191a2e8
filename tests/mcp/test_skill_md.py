"""SKILL.md: valid Agent Skills front matter, and every tool it names exists."""

from __future__ import annotations

import re

import pytest

from skill.tools import load_tools
from tests.mcp.conftest import REPO
from tests.mcp.scripted_client import _section, _steps, read_playbook

SKILL_MD = (REPO / "SKILL.md").read_text(encoding="utf-8")


def _front_matter() -> dict[str, str]:
    match = re.match(r"^---\n(?P<body>.*?)\n---\n", SKILL_MD, re.DOTALL)
    assert match, "SKILL.md starts with YAML front matter between --- lines"
    fields = {}
    for line in match["body"].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def test_front_matter_follows_the_agent_skills_spec():
    fields = _front_matter()
    assert set(fields) == {"name", "description"}
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", fields["name"]) and len(fields["name"]) <= 64
    assert 0 < len(fields["description"]) <= 1024
    assert "Use it when" in fields["description"]


def test_every_tool_the_playbook_names_is_registered():
    tools = load_tools()
    playbook = read_playbook(SKILL_MD)
    named = [step.tool for step in playbook.steps]
    assert named[0] == "analyze_hf_model" and named[-1] == "run_test_stage"
    assert [s.stages for s in playbook.steps if s.stages] == [[1, 2, 3, 4, 5, 6]]
    assert playbook.on_stage_failure.tool == "locate_divergence"
    missing = sorted(name for name in {*named, playbook.on_stage_failure.tool} if name not in tools)
    assert not missing, f"SKILL.md names tools the registry lacks: {missing}"
    # Each tool's call in SKILL.md only uses fields its input model has.
    for step in [*playbook.steps, playbook.on_stage_failure]:
        fields = set(re.findall(r'"([a-z_]+)":', step.call))
        assert fields <= set(tools[step.tool].input_model.model_fields), (step.tool, fields)


def test_step_11_exports_into_areal_with_a_registered_tool():
    """The last step, outside the porting playbook (it needs the user's AReaL path)."""
    tools = load_tools()
    (step,) = _steps(_section(SKILL_MD, "Step 11: export into AReaL"))
    assert step.tool == "export_to_areal" and step.tool in tools
    fields = set(re.findall(r'"([a-z_]+)":', step.call))
    assert fields == {"model_name", "areal", "dry_run"} and fields <= set(tools[step.tool].input_model.model_fields)
    section = _section(SKILL_MD, "Step 11: export into AReaL")
    for named in ('"overwrite"', '"python"', "`passed`", "`checks_error`", "`diff`", "archon-port export"):
        assert named in section, named
    for field in ("overwrite", "python", "passed", "checks_error", "diff"):
        model = tools[step.tool].input_model if field in ("overwrite", "python") else tools[step.tool].result_model
        assert field in model.model_fields, field


@pytest.mark.parametrize(
    "check",
    [
        "hf_keys_mapped",
        "config_attributes",
        "runtime_buffers_dropped",
        "moe_conversion",
        "tp_plan_qk_norm",
        "tp_plan_modules",
        "hand_edits_done",
        "import_line",
        "model_types",
        "logging_not_print",
    ],
)
def test_each_common_mistake_names_the_check_that_catches_it(check: str):
    from skill.porting import check_package

    assert f"`{check}`" in SKILL_MD
    assert f'"{check}"' in (REPO / "skill" / "porting" / "check_package.py").read_text(), check_package.__name__
