"""Which reader a local data path needs, from its name: one rule for prompts and corpora."""
import os


def detect_format(path: str) -> str:
    """"hf_dataset" for a directory (saved by HF datasets), "jsonl" for *.jsonl / *.json,
    else "text" (one record per non-empty line)."""
    if os.path.isdir(path):
        return "hf_dataset"
    return "jsonl" if path.endswith((".jsonl", ".json")) else "text"
