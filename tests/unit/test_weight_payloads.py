"""Weight payloads, the transports' declared kinds, and the trainer's side of a sync."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from llmrl.inference import Health
from llmrl.trainer.weight_sync import PolicyWeights, ShardedPolicyWeights, WeightSync
from llmrl.weights import (
    AdapterWeights,
    FullWeights,
    WeightSyncError,
    WeightTransport,
    WrongPayloadError,
    payload_from,
    transport_for,
)
from llmrl.weights.in_process import InProcessAdapters, InProcessWeights


def test_full_weights_are_one_stream_read_once_and_counted_as_read():
    produced = []

    def buckets():
        for index in range(3):
            produced.append(index)
            yield {f"model.layers.{index}.weight": torch.zeros(4)}

    payload = FullWeights(buckets())
    assert produced == [] and payload.nbytes == 0  # nothing is produced before it is read
    first = next(payload.buckets())
    assert list(first) == ["model.layers.0.weight"] and payload.nbytes == 16
    assert [list(b) for b in payload.buckets()] == [["model.layers.1.weight"], ["model.layers.2.weight"]]
    payload.drain()  # nothing left: draining again reads nothing
    assert produced == [0, 1, 2] and payload.nbytes == 48


def test_drain_produces_what_a_receiver_left_unread():
    produced = []

    def buckets():
        for index in range(3):
            produced.append(index)
            yield {f"w{index}": torch.zeros(1)}

    payload = FullWeights(buckets())
    next(payload.buckets())
    payload.drain()
    assert produced == [0, 1, 2]


def test_payload_from_reads_what_a_caller_may_pass(tmp_path):
    state = {"w": torch.ones(2)}
    assert payload_from(state).state_dict() == state
    assert payload_from(iter([state, {"v": torch.zeros(1)}])).state_dict().keys() == {"w", "v"}
    save_file(state, str(tmp_path / "weights.safetensors"))
    from_file = payload_from(tmp_path / "weights.safetensors")
    assert isinstance(from_file, FullWeights) and from_file.path == tmp_path / "weights.safetensors"
    assert torch.equal(from_file.state_dict()["w"], state["w"])
    adapter = AdapterWeights(
        {
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 3),
            "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": torch.zeros(4, 2),
        },
        {"r": 2, "lora_alpha": 4},
    )
    adapter.save(tmp_path / "adapter")
    read = payload_from(tmp_path / "adapter")
    assert isinstance(read, AdapterWeights) and read.config["r"] == 2 and read.path == tmp_path / "adapter"
    assert payload_from(adapter) is adapter
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        payload_from(tmp_path / "missing")


def test_a_transport_of_the_other_kind_is_refused_naming_what_is_served():
    transports = [InProcessWeights({}, lambda update: None, 10)]
    assert transport_for(transports, "weights", "here") is transports[0]
    with pytest.raises(WrongPayloadError, match="^here serves whole weights, not LoRA adapters$") as refused:
        transport_for(transports, "adapters", "here")
    assert isinstance(refused.value, WeightSyncError)
    both = [*transports, InProcessAdapters({}, lambda update: None, 10)]
    assert isinstance(transport_for(both, "adapters", "here"), InProcessAdapters)


def test_the_one_process_source_sends_the_state_dict_without_tied_names_and_counts_its_bytes():
    policy = torch.nn.Module()
    policy.embed = torch.nn.Embedding(4, 2)
    policy.head = torch.nn.Linear(2, 4, bias=False)
    policy.head.weight = policy.embed.weight
    source = PolicyWeights(policy, tied_names={"head.weight"})
    assert list(source.payload(None).state_dict()) == ["embed.weight"]

    sent = []

    class Recording:
        def weight_transport(self, kind):
            assert kind == "weights"
            return self

        def send(self, payload, version, *, reset=False):
            sent.append((list(payload.buckets()), version, reset))

        def health(self):
            return Health()

    sync = WeightSync(source, Recording())
    sync.sync(3, reset=True)
    assert [list(b) for b in sent[0][0]] == [["embed.weight"]] and sent[0][1:] == (3, True)
    assert sync.bytes_sent == 4 * 2 * 4


def test_a_process_that_does_not_generate_still_produces_every_bucket():
    produced = []

    class Gathered(PolicyWeights):
        def payload(self, into):
            assert into is None  # nothing reads it in this process

            def buckets():
                for index in range(4):
                    produced.append(index)  # a collective every process must take part in
                    yield {}

            return FullWeights(buckets())

    WeightSync(Gathered(torch.nn.Linear(1, 1), ()), inference=None).sync(1)
    assert produced == [0, 1, 2, 3]


def test_sharded_buckets_are_held_on_the_device_a_transport_in_this_process_takes():
    held = []

    class Gathering:
        device = "cuda:3"

        def gathered_buckets(self, model, bucket_bytes, *, held_on, skip, dtype):
            held.append(held_on)
            return iter([])

    class Elsewhere(WeightTransport[FullWeights]):
        takes = ("weights",)

        def send(self, payload, version, *, reset=False):
            pass

    source = ShardedPolicyWeights(
        torch.nn.Linear(1, 1), Gathering(), tied_names=(), bucket_bytes=1, dtype=torch.float32
    )
    for into in (None, InProcessWeights({}, lambda update: None, 10), Elsewhere()):
        source.payload(into)
    assert held == [None, "cuda:3", "cpu"]
