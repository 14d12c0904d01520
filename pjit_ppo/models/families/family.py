"""`Family`: everything pjit_ppo knows about one HF model family, in one value."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Tuple

from pjit_ppo.models.families.layout import Maps

if TYPE_CHECKING:
    from pjit_ppo.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family as HF stores it.

    Attributes:
      model_type: HF config.json `model_type`; also `ModelConfig.architecture`.
      hf_class: the causal-LM class named in config.json `architectures`.
      base_prefix: prefix of the base model's tensors in *ForCausalLM checkpoints
        (e.g. "transformer."); checkpoints of the bare base model omit it.
      config_fields: HF config.json dict -> ModelConfig fields, all but
        `architecture`, `hf_config` and the special-token ids.
      hf_fields: ModelConfig -> the family's config.json entries (for configs built
        by hand), all but `model_type`, `architectures` and the special-token ids.
      tensor_maps: ModelConfig -> {(our module path, param name): TensorMap} for
        every parameter, final norm and LM head included.
      aliases: HF tensor name -> other names the same tensor is known by.
    """
    model_type: str
    hf_class: str
    base_prefix: str
    config_fields: Callable[[Dict[str, Any]], Dict[str, Any]]
    hf_fields: Callable[[ModelConfig], Dict[str, Any]]
    tensor_maps: Callable[[ModelConfig], Maps]
    aliases: Mapping[str, Tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False)

    def candidate_names(self, name: str) -> Tuple[str, ...]:
        """Names HF tensor `name` may have in a checkpoint: as is, its aliases, and
        without the base-model prefix."""
        out = [name, *self.aliases.get(name, ())]
        if name.startswith(self.base_prefix):
            out.append(name[len(self.base_prefix):])
        return tuple(out)
