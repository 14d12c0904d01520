"""CPU demo of the critic-free estimators: configs/tiny_demo.py's model and reward, 4 samples
per prompt, no critic.

The argument picks the estimator and the loss aggregation its paper uses:
  ""/"grpo"      GRPO (group-normalised scores, k3 KL loss term), sequence mean
  "dr_grpo"      Dr. GRPO: no std normalisation, length-independent per-sequence sums
  "rloo"         RLOO (leave-one-out baseline, KL in the reward), per-sequence sums
  "reinforce_pp" REINFORCE++ (per-token KL rewards, batch-normalised returns), token mean
Run: python launch/train_ppo.py --config=configs/grpo_demo.py[:rloo] --workdir=/tmp/grpo
"""
from pjit_ppo.config import DataOptions, ModelOptions, PPOConfig, RewardOptions, RunConfig

VARIANTS = {
    "grpo": dict(advantage_estimator="grpo", loss_aggregation="sequence_mean"),
    "dr_grpo": dict(advantage_estimator="grpo", loss_aggregation="sequence_sum",
                    grpo_normalize_std=False),
    "rloo": dict(advantage_estimator="rloo", loss_aggregation="sequence_sum"),
    "reinforce_pp": dict(advantage_estimator="reinforce_pp", loss_aggregation="token_mean"),
}


def get_config(arg: str = "") -> RunConfig:
    name = arg or "grpo"
    if name not in VARIANTS:
        raise ValueError(f"configs/grpo_demo.py:{arg}; choose one of {', '.join(VARIANTS)}")
    return RunConfig(
        model=ModelOptions(random=dict(model_type="gpt2", vocab_size=64, n_embd=64, n_layer=2,
                                       n_head=4, n_positions=64,
                                       activation_function="gelu_new")),
        reward=RewardOptions(kind="target_tokens", target_ids=(5, 6, 7)),
        # 64 episodes per iteration = 16 prompts x 4 samples.
        ppo=PPOConfig(query_length=8, response_length=8, batch_size=64, samples_per_prompt=4,
                      nminibatches=2, noptepochs=4, total_episodes=64 * 40, temperature=1.0,
                      truncate_token=None, truncate_after=0, lr=3e-3, kl_loss_coef=0.04,
                      init_kl_coef=0.05, kl_controller="fixed", pad_token_id=63,
                      **VARIANTS[name]),
        data=DataOptions(low_token=8, min_prompt_length=2),
    )
