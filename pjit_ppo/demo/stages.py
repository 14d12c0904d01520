"""Running a demo's stages in order, each once: a stage that finished left a `DONE` file
(its result as JSON) in its directory and is skipped when the demo runs again, so an
interrupted demo loses no work (a training stage continues from its checkpoint)."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from absl import logging


def is_done(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "DONE"))


def mark_done(directory: str, info: Dict[str, Any]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "DONE"), "w") as f:
        json.dump(info, f, indent=2)


def read_done(directory: str) -> Dict[str, Any]:
    with open(os.path.join(directory, "DONE")) as f:
        return json.load(f)


def json_ready(tree):
    """`tree` with numpy scalars as floats and anything else JSON lacks as strings."""
    return json.loads(json.dumps(tree, default=lambda x: float(x) if np.ndim(x) == 0 else str(x)))


def read_jsonl(path: str) -> List[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_stages(stages: Sequence[str], run: Callable[[str], Dict[str, Any]],
               directory: Callable[[str], str], name: str = "demo"
               ) -> Tuple[Dict[str, Dict[str, Any]], Optional[str]]:
    """Runs each stage not yet done (`run(stage)` -> its result dict, written as
    directory(stage)/DONE with `_seconds`). Returns ({stage: result} of every stage,
    None), or (the results so far, the stage) when a stage returned {"preempted": True}
    (a signal stopped it after a checkpoint: the same call finishes the demo)."""
    info: Dict[str, Dict[str, Any]] = {}
    for number, stage in enumerate(stages, 1):
        where = directory(stage)
        if is_done(where):
            info[stage] = read_done(where)
            logging.info("%s stage %d/%d %s: already done", name, number, len(stages), stage)
            continue
        logging.info("%s stage %d/%d %s ...", name, number, len(stages), stage)
        start = time.time()
        result = dict(run(stage))
        if result.get("preempted"):  # a signal: the stage saved a checkpoint and returned
            logging.warning("%s stopped in stage %s by a signal; run the same command to "
                            "finish it", name, stage)
            return info, stage
        result["_seconds"] = time.time() - start
        mark_done(where, json_ready(result))
        info[stage] = read_done(where)
        logging.info("%s stage %s done in %.0f s", name, stage, result["_seconds"])
    return info, None
