"""The embedded RLHF demo: a procedural English-like corpus, a BPE tokenizer trained on it,
a noisy sentiment labeller (VADER's compound score as the "gold" human judgement), and the
pipeline that runs SFT -> reward learning -> PPO -> evaluation on them (`pipeline.run`)."""
