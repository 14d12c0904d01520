"""Which config changes a resumed run accepts: everything that alters what a run computes
must equal the checkpoint's; layout, length and logging may change."""
import json
from typing import Any, Dict, Optional, Tuple

#: Fields a resumed run may change: how it is laid out, how long it runs, what it logs.
#: Every other field must equal the checkpoint's (prefix match on the dotted name): among
#: them model.lora.* and ppo.critic_lora, since a checkpoint of adapters holds trees of
#: their shapes on their base (the base's fingerprint is checked beside the config).
RESUMABLE_CHANGES = ("mesh.", "num_iterations", "tensorboard", "measure_peak", "checkpoint.",
                     "evaluation.", "profile.")


def _flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(tree, dict):
        out: Dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def resume_conflicts(saved: Dict[str, Any], current: Dict[str, Any], *,
                     resumable: Tuple[str, ...] = RESUMABLE_CHANGES,
                     defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Tuple[Any, Any]]:
    """Fields whose value differs between a checkpoint's config and the current one.

    Both are a stage config's `to_dict()` (the saved one read back from JSON);
    `resumable`: dotted-name prefixes that may change (PPO's by default); `defaults`:
    the stage config's defaults as `to_dict()` (PPORunConfig's when None).
    Returns {dotted field: (saved value, current value)} for every field that is not
    in RESUMABLE_CHANGES; empty when the run may resume.
    """
    current = json_round_trip(current)
    a, b = _flatten(saved), _flatten(current)
    # A field the checkpoint lacks was added to the library after it was written; at
    # its default value it computes what the older version did.
    if defaults is None:
        from pjit_ppo.config.ppo import PPORunConfig
        defaults = PPORunConfig().to_dict()
    defaults = _flatten(json_round_trip(defaults))
    out = {}
    for name in sorted(set(a) | set(b)):
        if name.startswith(resumable):
            continue
        if name not in a and name in defaults and b.get(name) == defaults[name]:
            continue
        if a.get(name, "<absent>") != b.get(name, "<absent>"):
            out[name] = (a.get(name, "<absent>"), b.get(name, "<absent>"))
    return out


def json_round_trip(tree: Any) -> Any:
    """`tree` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(tree, default=str))
