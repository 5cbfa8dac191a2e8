"""An architecture fuzzer: random remote-code decoder families that transformers does not ship.

For a seed, :func:`sample_family` draws one point of the vocabulary the engine claims
(``skill/features.py``: norm kind and placement, QK norm, RoPE pairing / direction /
partial / scaling, attention variants, MLP and MoE kinds, multi-head latent attention,
fused q/k/v, tying, the catalogue's module naming schemes, scalar multipliers);
:func:`write_family` writes it as a checkpoint folder the way a model author publishes
remote code (``config.json`` with ``auto_map``, ``configuration_<name>.py``,
``modeling_<name>.py``, safetensors weights of realistic magnitude); and
:func:`check_family` proves the generated HF model itself right (forward, backward, a
save/load round trip, causality, and each feature's closed form where it has one).

This is test tooling: the engine (``skill``) never imports it. ``bench/fuzz_families.py``
ports every seed with ``archon-port add <folder> --trust-remote-code`` and tabulates what
happened; ``tests/skill/test_fuzz_families.py`` keeps a fixed seed set in the suite.
"""

from tests.fuzz.check import FamilyCheckError, check_family
from tests.fuzz.spec import FamilySpec, sample_family
from tests.fuzz.write import write_family

__all__ = ["FamilyCheckError", "FamilySpec", "check_family", "sample_family", "write_family"]
