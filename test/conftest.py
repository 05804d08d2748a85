import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_browser_console(request):
    """A test with the module's browser starts from an empty console log: what an earlier test
    left there (a test that failed before reading it) is not this test's error."""
    if "browser" in request.fixturenames:
        request.getfixturevalue("browser").get_log("browser")


@pytest.fixture(scope="module")
def dev():
    """The CUDA device for the kernel tests (gpu-marked: skipped without CUDA); fails when CUDA is
    present but the kernels did not build, which a skip would hide."""
    import torch

    from server.model import cuda_ops

    if not cuda_ops.available("cuda"):
        pytest.fail("CUDA is present but the kernels did not build (see the log)")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def parts():
    """(model, tokenizer, started engine) on the tiny synthetic model, shared by a test module."""
    import torch

    from server.config import Settings
    from server.engine import Engine
    from server.model import load_model
    from server.tokenizer import get_tokenizer

    model = load_model("synthetic:tiny", device="cpu", dtype=torch.float32, state_dtype=torch.float32)
    tok = get_tokenizer()
    eng = Engine(model, tok, Settings(device="cpu", max_batch=64, stats_interval=0, cuda_graphs=False))
    eng.start()
    yield model, tok, eng
    eng.shutdown()


BYTES = 256
"""byte_compiler's vocabulary: the 256 bytes; token 256 is the end."""


@pytest.fixture(scope="module")
def byte_compiler():
    """An xgrammar compiler over a vocabulary of the 256 bytes (token 256 ends), for random
    walks of compiled grammars (test_formats.py, test_schema_keywords.py)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([b]) for b in range(BYTES)] + [b""], xgr.VocabType.RAW,
                             vocab_size=BYTES + 1, stop_token_ids=[BYTES])  # fmt: skip
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
