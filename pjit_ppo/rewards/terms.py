"""reward.kind="terms": several reward kinds combined with weights.

    --config.reward.kind=terms --config.reward.path=RUN/reward/reward_model \\
    --config.reward.terms='("rm:model:1.0",
                            "fmt:function:0.5:pjit_ppo.rewards.functions:format_check")'

Each entry of `reward.terms` is "NAME:KIND:WEIGHT" or "NAME:KIND:WEIGHT:ARG": NAME a
metric-friendly name (letters, digits, _), KIND any other kind of
`pjit_ppo.rewards.registry.KINDS`, WEIGHT a finite number, ARG the kind's per-term
option (`RewardKind.term_arg`: the SPEC of a function term, the reward-model directory
of a model term, comma-separated token ids of a target_tokens term). Without ARG a term
reads the `reward` section's own field (reward.function, reward.path, reward.target_ids;
reward.head_seed and reward.allow_random_head always come from the section).

The score PPO and the critic-free estimators use is sum(WEIGHT * term score) (the
missing-stop penalty then replaces it for responses without a stop token, as for any
kind); each term's own mean is logged as `reward/NAME`. Device terms are computed in
the compiled program; function terms on the host (`pjit_ppo.rewards.host`), so a run
with one splits its rollout like reward.kind="function". A critic may start from the
first model term's trunk (ppo.critic_init="reward").

Like every kind, one module defining `KIND = RewardKind(...)` plus one line in
`pjit_ppo.rewards.registry` (here `KINDS["terms"] = terms.over(KINDS)`: the terms are of
the other kinds). jax-free at import.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from pjit_ppo.errors import ConfigError
from pjit_ppo.rewards.host import HostFunction, host_functions
from pjit_ppo.rewards.kind import Reward, RewardKind

FIELD = "reward.terms"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class Term(NamedTuple):
    """One parsed entry of reward.terms."""
    index: int
    name: str
    kind: str
    weight: float
    arg: Optional[str]

    @property
    def field(self) -> str:
        return f"{FIELD}[{self.index}]"


#: The kinds a term may be (the registry's KINDS, given by `over`; this module imports
#: no registry: the registry imports it).
_KINDS: Dict[str, RewardKind] = {}


def over(kinds: Dict[str, RewardKind]) -> RewardKind:
    """The "terms" kind over the registry's `kinds` (the dict itself: kinds registered
    later are terms' kinds too)."""
    global _KINDS
    _KINDS = kinds
    return KIND


def _kind(name: str) -> RewardKind:
    return _KINDS[name]


def parse_terms(entries) -> Tuple[Term, ...]:
    """reward.terms -> Terms; ConfigError naming the entry for any mistake."""
    kinds = _KINDS
    if not entries:
        raise ConfigError(f"reward.kind='terms' and {FIELD} is empty: list the terms as "
                          f"'name:kind:weight' (e.g. ('rm:model:1.0', "
                          f"'format:function:0.5:pjit_ppo.rewards.functions:format_check'))")
    out: List[Term] = []
    for i, entry in enumerate(entries):
        parts = entry.split(":", 3) if isinstance(entry, str) else []
        if len(parts) < 3:
            raise ConfigError(f"{FIELD}[{i}]={entry!r} must be 'name:kind:weight' or "
                              f"'name:kind:weight:arg'")
        name, kind, weight = (p.strip() for p in parts[:3])
        arg = parts[3] if len(parts) == 4 else None
        if not _NAME.match(name):
            raise ConfigError(f"{FIELD}[{i}]={entry!r}: the name {name!r} must start with a "
                              f"letter and hold only letters, digits and _ (it is logged as "
                              f"reward/<name>)")
        if any(t.name == name for t in out):
            raise ConfigError(f"{FIELD}[{i}]={entry!r}: the name {name!r} is used twice; give "
                              f"each term its own name")
        choices = [k for k in kinds if k != "terms"]
        if kind not in choices:
            raise ConfigError(f"{FIELD}[{i}]={entry!r}: unknown kind {kind!r}; choose one of "
                              f"{', '.join(map(repr, choices))}")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ConfigError(f"{FIELD}[{i}]={entry!r}: the weight {weight!r} must be a finite "
                              f"number")
        if arg is not None and kinds[kind].term_arg is None:
            raise ConfigError(f"{FIELD}[{i}]={entry!r}: a {kind!r} term takes no argument; "
                              f"write '{name}:{kind}:{weight}'")
        out.append(Term(i, name, kind, value, arg))
    return tuple(out)


def _arg_value(term: Term, field: str, current):
    """The term's ARG as the value of the `reward` field it sets."""
    if isinstance(current, tuple):  # target_ids: "5,6,7"
        try:
            return tuple(int(t) for t in term.arg.split(",") if t.strip())
        except ValueError:
            raise ConfigError(f"{term.arg!r} must be comma-separated token ids (this term's "
                              f"reward.{field})") from None
    return term.arg


def term_options(options, term: Term):
    """The `reward` section as the term's kind reads it (its kind; ARG set)."""
    changes = {"kind": term.kind, "terms": ()}
    field = _kind(term.kind).term_arg
    if term.arg is not None and field:
        changes[field] = _arg_value(term, field, getattr(options, field))
    return dataclasses.replace(options, **changes)


def term_config(config, term: Term):
    """The run config as the term's kind sees it (`term_options` in its reward section)."""
    return dataclasses.replace(config, reward=term_options(config.reward, term))


def _terms(config) -> Tuple[Term, ...]:
    return parse_terms(config.reward.terms)


# ------------------------------------------------------------------ the RewardFn
@dataclasses.dataclass(frozen=True, eq=False)
class WeightedTerms:
    """The RewardFn of weighted terms.

    names, weights: per term. fns: each term's RewardFn. host_counts: how many host
    columns each term reads (0 for a device term). host_functions: the host functions
    of every term, in column order (`pjit_ppo.rewards.host_functions`).
    """
    names: Tuple[str, ...]
    weights: Tuple[float, ...]
    fns: Tuple[Callable, ...]
    host_counts: Tuple[int, ...]
    host_functions: Tuple[HostFunction, ...]

    def terms(self, reward_params, query, query_mask, response, response_mask,
              host_scores=None):
        """Each term's own score: float32 [B, T] (T = len(names)).

        reward_params: {name: that term's params}; host_scores float32 [B, H] (H = the
        number of host functions), required when a term runs on the host."""
        import jax.numpy as jnp
        columns, offset = [], 0
        for name, fn, count in zip(self.names, self.fns, self.host_counts):
            params = reward_params[name] if reward_params is not None else None
            if count:
                if host_scores is None:
                    fn(params, query, query_mask, response, response_mask)  # its own message
                part = host_scores[:, offset:offset + count]
                offset += count
                score = fn(params, query, query_mask, response, response_mask, host_scores=part)
            else:
                score = fn(params, query, query_mask, response, response_mask)
            columns.append(score.astype(jnp.float32))
        return jnp.stack(columns, axis=1)

    def combine(self, terms):
        """sum_t weight_t * terms[:, t]: float32 [B]."""
        total = None
        for t, weight in enumerate(self.weights):
            part = terms[:, t] * weight
            total = part if total is None else total + part
        return total

    @property
    def program_key(self):
        """What the traced function depends on (`pjit_ppo.program_cache`): the names,
        weights, host columns and each term's own key; None when a term has none."""
        keys = tuple(getattr(fn, "program_key", None) for fn in self.fns)
        if None in keys:
            return None
        return repr(("terms", self.names, self.weights, self.host_counts, keys))

    def __call__(self, reward_params, query, query_mask, response, response_mask,
                 host_scores=None):
        return self.combine(self.terms(reward_params, query, query_mask, response,
                                       response_mask, host_scores))


# ------------------------------------------------------------------ the kind
def check(options) -> None:
    """Every entry parses, and each term's options pass its kind's check."""
    for term in parse_terms(options.terms):
        try:
            _kind(term.kind).check(term_options(options, term))
        except ConfigError as e:
            raise ConfigError(f"{term.field} ({term.name!r}): {e}") from None


def models(config):
    """Every term's models, in term order (a term's ARG named by its entry)."""
    out = []
    for term in _terms(config):
        kind = _kind(term.kind)
        for field, path in kind.models(term_config(config, term)):
            out.append((term.field if term.arg is not None and field == f"reward.{kind.term_arg}"
                        else field, path))
    return tuple(out)


def _split_models(config, reward_models):
    """(term, its config, its models) for every term."""
    out, i = [], 0
    for term in _terms(config):
        sub = term_config(config, term)
        n = len(_kind(term.kind).models(sub))
        out.append((term, sub, tuple(reward_models[i:i + n])))
        i += n
    return out


def check_fit(config, policy, reward_models) -> None:
    """Each term against the shapes; a critic from the reward needs a model term."""
    for term, sub, own in _split_models(config, reward_models):
        try:
            _kind(term.kind).check_fit(sub, policy, own)
        except ConfigError as e:
            raise ConfigError(f"{term.field} ({term.name!r}): {e}") from None
    ppo = config.ppo
    if ppo.uses_critic and not ppo.shared_trunk and ppo.critic_init == "reward" and not any(
            _kind(t.kind).critic_trunk for t in _terms(config)):
        raise ConfigError("ppo.critic_init='reward' needs a term with a model trunk (kind "
                          "'model') in reward.terms; use ppo.critic_init='policy'")


def flops(config, model) -> float:
    """The sum of the terms' FLOPs, each model term taken to have the shape `model`
    (`build` sums each built term's own FLOPs instead)."""
    total = 0.0
    for term in _terms(config):
        sub = term_config(config, term)
        kind = _kind(term.kind)
        total += kind.flops(sub, model if kind.models(sub) else None)
    return total


def build(config, make) -> Reward:
    """Each term built by its kind; params {name: params}; the first model term's
    architecture and trunk; FLOPs summed."""
    names, weights, fns, counts, hosts = [], [], [], [], []
    params, model, trunk, total = {}, None, None, 0.0
    for term in _terms(config):
        reward = _kind(term.kind).build(term_config(config, term), make)
        own = host_functions(reward.fn)
        names.append(term.name)
        weights.append(term.weight)
        fns.append(reward.fn)
        counts.append(len(own))
        hosts.extend(HostFunction(f.spec, f"{term.field} ({term.name!r})") for f in own)
        params[term.name] = reward.params
        total += reward.flops
        if model is None and reward.model is not None:
            model, trunk = reward.model, reward.trunk
    fn = WeightedTerms(tuple(names), tuple(weights), tuple(fns), tuple(counts), tuple(hosts))
    return Reward(fn=fn, params=params, model=model, trunk=trunk, flops=total)


def describe(config) -> str:
    return "; ".join(f"{t.name} (x {t.weight:g}): "
                     f"{_kind(t.kind).describe(term_config(config, t))}"
                     for t in _terms(config))


def functions(config):
    out = []
    for term in _terms(config):
        for _, spec in _kind(term.kind).functions(term_config(config, term)):
            out.append((f"{term.field} ({term.name!r})", spec))
    return tuple(out)


KIND = RewardKind(name="terms", check=check, models=models, check_fit=check_fit,
                  build=build, flops=flops, describe=describe, critic_trunk=True,
                  term_arg=None, functions=functions)
