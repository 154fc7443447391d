"""Per-checkpoint side data made on first use (cache/calibration.py): a policy's `prepare` writes the
calibration file beside the checkpoint once, with a one-line note, and the policy then reads it."""
import torch

from cache import make_policy
from cache.calibration import (CALIBRATION_TEXT, calibration_blocks, channels_path, pod_path, read_channels_file,
                               read_pod_file)
from tests.helpers import tiny_hf_model


class CharTokenizer:
    """Token ids for a 128-token tiny model: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 128 for c in text]


def tiny(tmp_path):
    _, model = tiny_hf_model("tied_gqa3", tmp_path / "model")
    model.args.checkpoint = str(tmp_path / "model")
    return model


def test_calibration_blocks_come_from_the_bundled_text():
    blocks = calibration_blocks(CharTokenizer(), CALIBRATION_TEXT, 2000, 512)
    assert [len(b) for b in blocks] == [512, 512, 512]
    assert sorted(CALIBRATION_TEXT.glob("*.txt"))[0].read_text().startswith("".join(map(chr, blocks[0][:20])))


def test_channels_are_calibrated_on_first_use_then_reused(tmp_path, capsys):
    model = tiny(tmp_path)
    path = channels_path(model.args.checkpoint)
    policy = make_policy("ds", "heavy_channels=4")
    model.setup_caches(1, 16, policy)
    assert policy.describe()["heavy_channels_source"].startswith("prompt")     # not prepared: no file
    make_policy("ds").prepare(model, CharTokenizer())
    assert path.exists() and "calibrating heavy channels" in capsys.readouterr().err
    stamp = path.stat().st_mtime_ns
    policy = make_policy("snapkv+hshare", "heavy_channels=4")
    policy.prepare(model, CharTokenizer())                                       # file there: nothing to do
    assert path.stat().st_mtime_ns == stamp and capsys.readouterr().err == ""
    model.setup_caches(1, 16, policy)
    assert policy.describe()["heavy_channels_source"] == f"calibrated: {path}"
    ranking = read_channels_file(path, model.args)
    assert torch.equal(policy.calibrated, ranking)
    make_policy("ds", "channels=prompt").prepare(model, CharTokenizer())         # never asks for the file
    assert capsys.readouterr().err == ""


def test_pod_blocks_are_calibrated_on_first_use(tmp_path, capsys):
    model = tiny(tmp_path)
    path = pod_path(model.args.checkpoint)
    make_policy("pod", "blocks=layers").prepare(model, CharTokenizer())
    assert not path.exists()
    make_policy("pod").prepare(model, CharTokenizer())
    assert path.exists() and "calibrating POD layer similarity" in capsys.readouterr().err
    blocks, sim = read_pod_file(path, model.args, 0.5)
    assert sim.shape == (2, 2, 2) and len(blocks) == 2
    policy = make_policy("pod", "n_sink=2,n_recent=5")
    model.setup_caches(1, 16, policy)
    assert policy.describe()["blocks_source"] == str(path)
