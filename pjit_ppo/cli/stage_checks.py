"""Pre-flight checks of the SFT and reward-learning entry points: the config's type and
values, the directories it names and the label file, before jax starts (ConfigError /
DataError, which the entry points print as one line with exit status 2: wrap the
calls in `common.config_errors()` and `data_errors()`)."""
import contextlib
import os

from pjit_ppo.cli import flag_errors
from pjit_ppo.config import ConfigError


@contextlib.contextmanager
def data_errors():
    """A DataError (a bad corpus / label file) as one line on stderr, exit status 2."""
    from pjit_ppo.errors import DataError
    try:
        yield
    except DataError as e:
        flag_errors.fail(str(e), "data")


def _check_type(config, cls, script: str) -> None:
    if not isinstance(config, cls):
        raise ConfigError(f"the recipe's get_config() returned {type(config).__name__}; "
                          f"{script} needs a {cls.__name__} (pjit_ppo/stage_config.py)")


def _check_dirs(config, fields) -> None:
    for field, path in fields:
        if path and not os.path.isdir(path):
            raise ConfigError(f"{field}={path!r} is not a directory; point it at an HF "
                              f"model / tokenizer directory")


def check_sft(config) -> None:
    """SFTConfig values, its model and tokenizer directories, the corpus files."""
    from pjit_ppo.data import corpus
    from pjit_ppo.config import SFTConfig
    _check_type(config, SFTConfig, "train_sft")
    config.validate()
    _check_dirs(config, [("model.policy_path", config.model.policy_path),
                         ("tokenizer_path", config.tokenizer_path)])
    fields = dict(fmt=config.data_format, text_field=config.text_field,
                  prompt_field=config.prompt_field, completion_field=config.completion_field)
    corpus.load_documents(config.data_path, **fields)
    if config.eval_path:
        corpus.load_documents(config.eval_path, **fields)


def check_reward(config) -> None:
    """RewardLearningConfig values, its directories, and every label record."""
    from pjit_ppo.data import preferences
    from pjit_ppo.config import RewardLearningConfig
    _check_type(config, RewardLearningConfig, "train_reward")
    config.validate()
    _check_dirs(config, [("model.policy_path", config.model.policy_path),
                         ("init_path", config.init_path),
                         ("tokenizer_path", config.tokenizer_path)])
    preferences.load_preferences(config.labels_path)
    if config.test_labels_path:
        preferences.load_preferences(config.test_labels_path)
