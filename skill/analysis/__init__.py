"""Step 1 of the porting playbook: analyse a HuggingFace decoder-only family.

``analyze_hf_model(AnalyzeInput) -> ArchitectureReport``; the modules split the work by
concern: ``inputs`` (resolving and refusing sources), ``modules`` (the module tree),
``probes`` (numerical probes), ``source_scan`` (libcst), ``detect`` (the checklist),
``config_fields``, ``reference`` (nearest reference, deltas) and ``report`` (models).
"""

from skill.analysis.analyze import analyze_hf_model
from skill.analysis.inputs import AnalysisError, decoder_only_candidates
from skill.analysis.report import AnalyzeInput, ArchitectureReport

__all__ = ["AnalysisError", "AnalyzeInput", "ArchitectureReport", "analyze_hf_model", "decoder_only_candidates"]
