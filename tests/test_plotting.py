"""pergrad.plotting writes real images."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pergrad import outliers, plotting

plt = pytest.importorskip("matplotlib.pyplot", reason="plotting needs matplotlib (the plot extra)")


@pytest.mark.parametrize("log_scale", [False, True])
def test_histogram_writes_a_png(fw, tmp_path, log_scale):
    norms = np.abs(np.random.default_rng(3).lognormal(size=300))
    norms[[5, 9]] = [60.0, 80.0]
    found = outliers.detect(fw.array(norms), method="iqr")
    path = tmp_path / "norms.png"
    fig = plotting.norm_histogram(fw.array(norms), outliers=found, path=path, log_scale=log_scale)
    image = plt.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # not a blank canvas
    labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert any("flagged" in label for label in labels)
    plt.close(fig)


def test_bad_input(fw):
    with pytest.raises(ValueError, match="log_scale=True needs positive norms"):
        plotting.norm_histogram(fw.array(np.array([0.0, 1.0])), log_scale=True)
    with pytest.raises(ValueError, match="bins must be a positive int"):
        plotting.norm_histogram(fw.array(np.ones(3)), bins=0)
    with pytest.raises(TypeError, match="outliers must be a pergrad.outliers.detect result"):
        plotting.norm_histogram(fw.array(np.ones(3)), outliers=[1])


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pergrad\[plot\]"):
        plotting.norm_histogram(np.ones(3))
