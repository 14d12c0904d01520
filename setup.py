"""pjit_ppo: PPO from human preferences for GPT-J-scale models with Haiku + pjit.

GPU pods: install the CUDA build of jax first, at the same version as the pin
below, e.g. ``pip install "jax[cuda12]==0.10.2"``, then ``pip install -e .``.
The library itself never imports torch; torch is only a test dependency (the
parity tests compare against transformers' PyTorch models).
"""
import setuptools

setuptools.setup(
    name="pjit_ppo",
    version="0.1.0",
    description="Haiku + pjit PPO trainer for language models from human preferences",
    packages=setuptools.find_packages(include=["pjit_ppo", "pjit_ppo.*"]),
    python_requires=">=3.10",
    # What the library imports, and nothing else.
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "dm-haiku==0.0.17",
        "optax==0.2.8",
        "absl-py>=2.5,<3",
        "ml-collections==1.1.0",
        "orbax-checkpoint==0.12.8",
        "numpy>=1.26",
        # 0.7.0 registers its NumPy casts and ufunc loops in quadratic time: importing it
        # costs 0.8-1.0 CPU-s against 0.006 s for 0.6.0, in every process that imports jax
        # (measured 2026-12-06, numpy 2.4). jax 0.10.2 needs >= 0.5.
        "ml_dtypes>=0.5,<0.7",
        "tensorboardX>=2.6",
        # Text prompts and labels: HF tokenizers (transformers' tokenizer classes work
        # without torch) and safetensors for HF checkpoints.
        "transformers>=5,<6",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        # llama.cpp GGUF files (pjit_ppo.models.gguf): header parsing and dequantization.
        "gguf==0.19.0",
    ],
    extras_require={
        # transformers (PyTorch models) is only needed to check parity and to
        # make tiny checkpoints in tests; torch is pinned to the CPU wheel.
        # pytest-xdist: the suite runs in two worker processes (pytest.ini).
        "test": ["pytest>=8", "pytest-xdist==3.8.0", "torch==2.13.0", "vaderSentiment==3.3.2",
                 "matplotlib>=3.8", "datasets>=3", "peft==0.21.2", "jinja2>=3.1"],
        # The demos: VADER, the gold sentiment judge (launch/demo.py), plots, and jinja2
        # for the chat template of the math demo's model (launch/demo_math.py).
        "demo": ["vaderSentiment==3.3.2", "matplotlib>=3.8", "jinja2>=3.1"],
    },
    entry_points={
        "console_scripts": [
            "pjit-ppo-train = pjit_ppo.cli.train_ppo:run_main",
            "pjit-ppo-evaluate = pjit_ppo.cli.evaluate:run_main",
            "pjit-ppo-export = pjit_ppo.cli.export_hf:run_main",
            "pjit-ppo-plan = pjit_ppo.cli.plan:run_main",
            "pjit-ppo-sft = pjit_ppo.cli.train_sft:run_main",
            "pjit-ppo-reward = pjit_ppo.cli.train_reward:run_main",
            "pjit-ppo-dpo = pjit_ppo.cli.train_dpo:run_main",
            "pjit-ppo-demo = pjit_ppo.cli.demo:run_main",
            "pjit-ppo-demo-math = pjit_ppo.cli.demo_math:run_main",
        ],
    },
)
