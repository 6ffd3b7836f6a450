"""Checkpoints are data: loading one never runs code the checkpoint names, and bad files fail by name."""

import pytest
import torch

from project.errors import UserError
from project.runs.checkpoints import check_readable, load_model


def test_a_checkpoint_naming_code_outside_the_project_is_not_built(tmp_path):
    path = tmp_path / "evil.ckpt"
    config = {
        "model": {
            "_target_": "project.models.classifier.ImageClassifier",
            "net": {"_target_": "os.system", "command": "touch pwned"},
        }
    }
    torch.save({"hyper_parameters": config, "state_dict": {}}, path)
    with pytest.raises(UserError, match=r"refusing to build \['os.system'\]"):
        load_model(str(path))
    assert not (tmp_path / "pwned").exists()


def test_a_directory_without_shard_metadata_is_not_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="not a sharded checkpoint"):
        check_readable(str(tmp_path))


def test_a_checkpoint_from_elsewhere_has_no_run_config(tmp_path):
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(UserError, match="holds no run config"):
        load_model(str(path))
