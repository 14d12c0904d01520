"""A PPO run's LoRA trees: what the passes read when the policy (and critic) train
adapters on frozen bases.

With model.lora.rank > 0 the train state holds only what trains:

  params["policy"]   the policy's adapters; their base is frozen["ref"], the reference
                     (the initial policy = the base without adapters: one set of base
                     weights serves both)
  params["critic"]   with ppo.critic_lora: the critic's adapters and its value head;
                     their base is the trunk of frozen["ref"] or of the reward model
                     (`PPOModels.critic_base`); otherwise the whole critic, as without LoRA

`view` gives every pass the trees it reads (the adapters attached to their bases: a dict
union, no copy); the update reads the bases as an argument of its compiled program
(`update_frozen`), not donated. Without LoRA both are the identity / None, and the
programs are those of a run without adapters.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax

from pjit_ppo.models import lora
from pjit_ppo.models.assemble import trunk_only
from pjit_ppo.ppo.types import PPOModels


def uses_adapters(models: PPOModels) -> bool:
    """Whether the run trains LoRA adapters (on the policy; the critic follows it)."""
    return models.policy.lora is not None


def dropout(models: PPOModels) -> bool:
    """Whether the update drops out the adapters' input (model.lora.dropout > 0)."""
    return uses_adapters(models) and models.policy.lora.dropout > 0


def _at(tree, path: Tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def critic_base_path(frozen_reward) -> Tuple[str, ...]:
    """Where the reward model's trunk is in frozen["reward"] (a reward model's params, or
    a reward of terms {name: params}, the first term with a trunk): the base of a LoRA
    critic with ppo.critic_init="reward". Raises ValueError when there is none."""
    if isinstance(frozen_reward, dict) and "transformer/embed" in frozen_reward:
        return ("reward",)
    for name, params in (frozen_reward or {}).items():
        if isinstance(params, dict) and "transformer/embed" in params:
            return ("reward", name)
    raise ValueError("the reward has no model trunk for a LoRA critic to sit on")


def view(models: PPOModels, params, frozen, dropout_key: Optional[jax.Array] = None):
    """The trainable tree as the passes read it: params["policy"] (and params["critic"]
    of a LoRA critic) attached to their frozen bases. `frozen` holds at least the bases
    (`update_frozen`); dropout_key: an update micro-step's key (dropout), else None.
    Without adapters: `params` itself."""
    if not uses_adapters(models):
        return params
    keys = (None, None) if dropout_key is None else tuple(jax.random.split(dropout_key))
    out = dict(params)
    out["policy"] = lora.attach(frozen["ref"], params["policy"], keys[0])
    if models.critic_base is not None:
        out["critic"] = lora.attach(trunk_only(_at(frozen, models.critic_base)),
                                    params["critic"], keys[1])
    return out


def policy_view(models: PPOModels, policy, base):
    """params["policy"] as the sampler reads it: the adapters on `base` (frozen["ref"]),
    or the policy itself without adapters (base None)."""
    return policy if base is None else lora.attach(base, policy)


def update_frozen(models: PPOModels, frozen) -> Optional[Dict[str, Any]]:
    """The frozen models the update reads (the adapters' bases), or None without
    adapters: {"ref"} and, for a LoRA critic on the reward trunk, {"reward"}."""
    if not uses_adapters(models):
        return None
    names = ["ref"]
    if models.critic_base is not None and models.critic_base[0] not in names:
        names.append(models.critic_base[0])
    return {name: frozen[name] for name in names}


def bases(models: PPOModels, frozen) -> Dict[str, Any]:
    """{"policy": base tree, "critic": trunk} the adapters sit on (what a checkpoint's
    fingerprint covers); {} without adapters."""
    if not uses_adapters(models):
        return {}
    out = {"policy": frozen["ref"]}
    if models.critic_base is not None:
        out["critic"] = trunk_only(_at(frozen, models.critic_base))
    return out


def base_fingerprints(models: PPOModels, frozen) -> Dict[str, str]:
    """{name: `lora.fingerprint`} of each base in `bases` (real arrays only)."""
    return {name: lora.fingerprint(tree) for name, tree in bases(models, frozen).items()}
