"""evals/feature_scale.py's table: channel RMS and the energy share of the five largest."""

import torch

from evals.feature_scale import channel_table


def test_one_loud_channel_holds_its_share_of_the_energy():
    count = 4
    rms = torch.ones(2, 10)
    rms[1, 3] = 30.0  # the second layer's one massive channel
    (first, second) = channel_table(rms.pow(2) * count, count, [2, 15])
    assert first == {
        "layer": 2,
        "rms_median": 1.0,
        "rms_max": 1.0,
        "rms_top5": [1.0] * 5,
        "top5_energy_share": 0.5,
    }
    assert second["rms_max"] == 30.0 and second["rms_top5"] == [30.0, 1.0, 1.0, 1.0, 1.0]
    assert second["top5_energy_share"] == round((900 + 4) / (900 + 9), 4)
