from kroquant_jax.norm_commutation import deviations
from scripts.norm_commutation import COMMUTES_BELOW, main


def test_only_rmsnorm_commutes_with_rotation():
    devs = deviations(64, 32, seed=42)
    assert set(devs) == {"RMSNorm", "LayerNorm", "BatchNorm", "GroupNorm", "AdaLN", "AdaRMSNorm"}
    assert devs["RMSNorm"] < COMMUTES_BELOW
    for name, dev in devs.items():
        if name != "RMSNorm":
            assert dev > 0.1, (name, dev)  # O(1) deviations, as in the paper's Table 5


def test_script_prints_table(capsys):
    main([])
    out = capsys.readouterr().out
    assert "| RMSNorm |" in out and out.count("| no |") == 5 and out.count("| yes |") == 1
