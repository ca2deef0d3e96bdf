"""The kernels' build folder is keyed by what the build depends on and where its
sources are, so two environments or checkouts sharing TORCH_EXTENSIONS_DIR keep
their own builds (torch's builder rebuilds when the source paths change)."""

import shutil

from minivllm.cpu import _custom_ops


def test_build_key_follows_torch_flags_and_sources(tmp_path, monkeypatch):
    here = _custom_ops.build_key()
    csrc = tmp_path / "csrc"
    shutil.copytree(_custom_ops.CSRC, csrc)
    monkeypatch.setattr(_custom_ops, "CSRC", csrc)
    base = _custom_ops.build_key()
    assert base != here  # the same sources in another checkout: a folder of its own
    assert _custom_ops.build_key() == base  # nothing changed: the same folder
    monkeypatch.setattr(_custom_ops.torch, "__version__", "0.0.0+other")
    other_torch = _custom_ops.build_key()
    monkeypatch.undo()
    monkeypatch.setattr(_custom_ops, "CSRC", csrc)
    (csrc / "gemm.cpp").write_text((csrc / "gemm.cpp").read_text() + "\n// edited\n")
    edited = _custom_ops.build_key()
    monkeypatch.setenv("CXX", "clang++")
    other_compiler = _custom_ops.build_key()
    assert len({base, other_torch, edited, other_compiler}) == 4


def test_build_directory_is_under_the_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = _custom_ops.build_directory("minivllm_C_native")
    assert folder.parent.parent == tmp_path
    assert folder.name == f"minivllm_C_native-{_custom_ops.build_key()}"
