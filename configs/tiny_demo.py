"""CPU demo: a tiny random GPT-2-architecture policy learns to emit target tokens.

The reward is a fixed function of the tokens (fraction of target tokens in the
truncated response), so learning shows within a few dozen iterations on a laptop
(a few seconds per iteration on CPU).
Run: python launch/train_ppo.py --config=configs/tiny_demo.py --workdir=/tmp/demo
"""
from pjit_ppo.config import DataOptions, ModelOptions, PPOConfig, RewardOptions, RunConfig


def get_config(arg: str = "") -> RunConfig:
    del arg
    return RunConfig(
        model=ModelOptions(random=dict(model_type="gpt2", vocab_size=64, n_embd=64, n_layer=2,
                                       n_head=4, n_positions=64,
                                       activation_function="gelu_new")),
        reward=RewardOptions(kind="target_tokens", target_ids=(5, 6, 7)),
        ppo=PPOConfig(query_length=8, response_length=8, batch_size=64, nminibatches=2,
                      noptepochs=4, total_episodes=64 * 40, temperature=1.0,
                      truncate_token=None, truncate_after=0, lr=3e-3, init_kl_coef=0.05,
                      kl_controller="fixed", critic_init="policy", whiten_rewards=False,
                      pad_token_id=63),
        data=DataOptions(low_token=8, min_prompt_length=2),
    )
