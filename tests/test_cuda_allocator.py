"""Every CUDA rank of a replica (and each stage) runs the caching allocator with expandable segments, unless the
operator set PYTORCH_CUDA_ALLOC_CONF: pack sizes change every step, which fragments fixed segments."""

from h3serve.replicas import allocator
from h3serve.replicas.allocator import DEFAULT, VARIABLE, cuda_allocator_defaults


def test_cuda_gets_expandable_segments_unless_the_operator_set_the_variable(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    assert cuda_allocator_defaults("cpu") is None and VARIABLE not in allocator.os.environ
    assert cuda_allocator_defaults("cuda") == DEFAULT == allocator.os.environ[VARIABLE] == "expandable_segments:True"
    monkeypatch.setenv(VARIABLE, "max_split_size_mb:512")
    assert cuda_allocator_defaults("cuda") == "max_split_size_mb:512"  # the operator's own, untouched
    assert allocator.os.environ[VARIABLE] == "max_split_size_mb:512"
