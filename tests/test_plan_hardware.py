"""lmforge.plan.hardware: catalogue, cluster specs, user device files."""

from __future__ import annotations

import pytest

from lmforge.plan.hardware import CATALOGUE, get_device, load_devices, parse_cluster


def test_catalogue_has_the_required_devices():
    for name in ("V100", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "TPU-v4", "CPU"):
        dev = CATALOGUE[name]
        assert dev.memory_gb > 0 and dev.intra_node_gbps > 0 and dev.inter_node_gbps > 0
    assert CATALOGUE["H100-SXM"].peak_flops("bf16") == 989e12
    assert CATALOGUE["H100-SXM"].peak_flops("fp8") == 1979e12
    assert CATALOGUE["A100-80GB"].peak_flops("fp16") == 312e12
    assert CATALOGUE["V100"].peak_flops("fp16") == 125e12
    assert CATALOGUE["H200"].memory_gb == 141


def test_unsupported_precision_names_the_device():
    with pytest.raises(ValueError, match="V100 has no bf16"):
        CATALOGUE["V100"].peak_flops("bf16")
    with pytest.raises(ValueError, match="fp4"):
        CATALOGUE["H100-SXM"].peak_flops("fp4")


@pytest.mark.parametrize("spec,nodes,gpn,name", [
    ("64x8xH100", 64, 8, "H100-SXM"),
    ("8xA100-80GB", 1, 8, "A100-80GB"),
    ("h200", 1, 1, "H200"),
    ("2 x 4 x tpu-v4", 2, 4, "TPU-v4"),
    ("16xB200", 1, 16, "B200"),
])
def test_parse_cluster(spec, nodes, gpn, name):
    c = parse_cluster(spec)
    assert (c.nodes, c.gpus_per_node, c.device.name) == (nodes, gpn, name)
    assert c.world_size == nodes * gpn


def test_parse_cluster_nodes_flag():
    c = parse_cluster("8xH100", nodes=4)
    assert (c.nodes, c.gpus_per_node, c.world_size) == (4, 8, 32)
    with pytest.raises(ValueError, match="contradicts"):
        parse_cluster("2x8xH100", nodes=4)


def test_unknown_gpu_lists_the_catalogue():
    with pytest.raises(ValueError) as err:
        parse_cluster("8xRTX9090")
    msg = str(err.value)
    assert "'RTX9090'" in msg and "H100-SXM" in msg and "A100-80GB" in msg and "TPU-v4" in msg


def test_extra_devices_from_toml(tmp_path):
    f = tmp_path / "devs.toml"
    f.write_text('[MI300X]\nmemory_gb = 192\nbf16_tflops = 1307\nfp8_tflops = 2615\n'
                 'intra_node_gbps = 448\ninter_node_gbps = 50\naliases = ["mi300"]\n')
    devs = load_devices(f)
    assert "H100-SXM" in devs and devs["MI300X"].memory_gb == 192
    c = parse_cluster("4x8xmi300", devices=devs)
    assert c.device.name == "MI300X" and c.device.peak_flops("bf16") == 1307e12
    assert get_device("MI300X", devs).fp16_tflops is None


def test_bad_device_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[X]\nmemory_gb = 1\nbf16_tflops = 1\nintra_node_gbps = 1\ninter_node_gbps = 1\nwarp = 3\n')
    with pytest.raises(ValueError, match="warp"):
        load_devices(f)
    with pytest.raises(ValueError, match="does not exist"):
        load_devices(tmp_path / "missing.toml")
