"""The run-time adapter registry (``h3serve.deploy.jobs.adapter_registry``) on the job store's two kinds: a local
directory and an fsspec URL (memory://). Torch-free, no Ray."""

import threading
import uuid

import pytest

from h3serve.deploy.jobs.adapter_registry import HEAD, AdapterRegistry, generation_name
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.pipelines.h3.lora_spec import LoraSpec


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path) -> MediaStore:
    url = str(tmp_path / "store") if request.param == "local" else f"memory://registry-{uuid.uuid4().hex}"
    return MediaStore(url)


def test_a_change_is_a_new_generation_every_reader_sees(store, tmp_path):
    admin, reader = AdapterRegistry(store), AdapterRegistry(store, ttl_s=60.0)
    assert reader.read().generation == 0 and reader.read().loras == {}
    added = admin.change(lambda loras: {**loras, "detail": LoraSpec(path=tmp_path, scale=0.8, steps=4)})
    assert added.generation == 1
    assert reader.read().generation == 0  # its copy is younger than its ttl
    assert reader.cached() is not None and reader.cached().generation == 0
    fresh = reader.read(fresh=True)
    assert fresh.generation == 1 and fresh.loras == {"detail": LoraSpec(path=tmp_path, scale=0.8, steps=4)}
    admin.change(lambda loras: {n: s for n, s in loras.items() if n != "detail"})
    assert AdapterRegistry(store).read().generation == 2 and AdapterRegistry(store).read().loras == {}


def test_a_reader_steps_past_a_head_that_lags(store, tmp_path):
    admin = AdapterRegistry(store)
    admin.change(lambda loras: {**loras, "a": LoraSpec(path=tmp_path)})
    admin.change(lambda loras: {**loras, "b": LoraSpec(path=tmp_path)})
    store.put(HEAD, b"1")  # the writer of generation 2 died between its generation and the head
    latest = AdapterRegistry(store).read()
    assert latest.generation == 2 and sorted(latest.loras) == ["a", "b"]


def test_concurrent_admins_each_change_once_and_none_is_lost(tmp_path):
    """Eight writers at once on one directory: the exclusive create makes each lose at most a race and retry."""
    store = MediaStore(str(tmp_path / "store"))
    errors: list[BaseException] = []

    def add(name: str) -> None:
        try:
            AdapterRegistry(store).change(lambda loras: {**loras, name: LoraSpec(path=tmp_path)})
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=add, args=(f"a{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    latest = AdapterRegistry(store).read()
    assert latest.generation == 8 and sorted(latest.loras) == sorted(f"a{i}" for i in range(8))
    assert all(store.exists(generation_name(g)) for g in range(1, 9))


def test_an_edit_that_refuses_writes_nothing(store, tmp_path):
    admin = AdapterRegistry(store)
    admin.change(lambda loras: {**loras, "a": LoraSpec(path=tmp_path)})

    def refuse(loras):
        raise KeyError("a is served")

    with pytest.raises(KeyError):
        admin.change(refuse)
    assert AdapterRegistry(store).read().generation == 1 and not store.exists(generation_name(2))
