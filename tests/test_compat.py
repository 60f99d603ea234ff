"""Each private torch name in mirrorgrad._compat must resolve, with the signature we use."""

import inspect

from mirrorgrad import _compat


def test_torch_version_supported():
    assert _compat.TORCH_VERSION >= (2, 11)


def test_extract_fwd_bwd_modules_signature():
    params = inspect.signature(_compat.extract_fwd_bwd_modules).parameters
    for name in ("joint_module", "saved_values", "saved_sym_nodes", "num_fwd_outputs"):
        assert name in params, f"torch changed _extract_fwd_bwd_modules: no {name!r}"
    assert params["num_fwd_outputs"].kind is inspect.Parameter.KEYWORD_ONLY


def test_partitioners_take_num_fwd_outputs():
    for fn in (_compat.default_partition, _compat.min_cut_rematerialization_partition):
        assert "num_fwd_outputs" in inspect.signature(fn).parameters, fn.__name__


def test_aot_function_takes_partition_fn():
    assert "partition_fn" in inspect.signature(_compat.aot_function).parameters
