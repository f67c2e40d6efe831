"""Workloads without training: the batch convention, the objectives, the data sources' checks
(every bad-data case is refused before any worker starts, naming the field), tensor-parallel
specs from a model's own plan, and what `orch check` refuses for models that cannot pipeline."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from helpers.config import compose_config
from helpers.orch_command import orch_run
from orch.checking import check_run
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.model.workload import (
    batch_targets,
    call_model,
    checkpoint_units,
    enable_activation_checkpointing,
    move_batch,
    output_tensor,
)
from orch.plans.parallel.tp_plan import specs_from_tp_plan
from orch.workload import resolve_workload
from orch.workloads.dataset import DatasetSource
from orch.workloads.images import ImageSource
from orch.workloads.objectives import CausalLM, Classification
from orch.workloads.text import TextSource


def check(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    return check_run(typed, model_cfg)


def refusal(*overrides: str) -> str:
    with pytest.raises(PlanError) as info:
        check(*overrides)
    return str(info.value)


# The batch convention and the objectives.

class _Keywords(torch.nn.Module):
    def forward(self, x, labels=None):
        return (x * 2, "extra")


def test_a_dict_batch_is_passed_as_keywords_and_a_pair_as_its_inputs():
    model = _Keywords()
    assert torch.equal(output_tensor(call_model(model, {"x": torch.ones(2), "labels": torch.zeros(2)})),
                       torch.full((2,), 2.0))
    assert torch.equal(output_tensor(call_model(model, (torch.ones(2), torch.zeros(2)))), torch.full((2,), 2.0))
    assert torch.equal(batch_targets({"x": 1, "labels": torch.ones(1)}), torch.ones(1))
    assert torch.equal(batch_targets((torch.zeros(1), torch.ones(1))), torch.ones(1))
    moved = move_batch({"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)}, "meta", torch.bfloat16)
    assert moved["x"].dtype == torch.bfloat16 and moved["ids"].dtype == torch.long and moved["x"].is_meta


def test_objectives_take_any_output_shape_and_trust_a_models_own_loss():
    logits, labels = torch.tensor([[4.0, 0.0], [0.0, 4.0], [4.0, 0.0]]), torch.tensor([0, 1, 1])
    loss = Classification()(logits, (None, labels))
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item())
    assert Classification().metrics((logits,), (None, labels))["accuracy"].item() == pytest.approx(2 / 3)

    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(64, (2, 8))
    with_labels = model(input_ids=ids, labels=ids)  # a ModelOutput with .loss
    assert CausalLM()(with_labels, {"input_ids": ids, "labels": ids}) is with_labels.loss
    plain = CausalLM()(model(ids[:, :-1]), (ids[:, :-1], ids[:, 1:]))  # .logits against shifted targets
    assert plain.shape == () and plain.item() > 0


# Tensor parallelism from the model's own plan, and refusals in `orch check`.

def test_a_llama_models_own_plan_becomes_autotp_specs_for_every_projection():
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    specs = specs_from_tp_plan(model)
    kinds = {}
    for name, _ in model.named_parameters():
        matched = [s["partition_type"] for s in specs if any(re.match(p, name) for p in s["patterns"])]
        kinds[name] = matched[0] if matched else None
    for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert kinds[f"model.layers.1.{'self_attn' if proj[0] in 'qkv' else 'mlp'}.{proj}.weight"] == "column"
    assert kinds["model.layers.0.self_attn.o_proj.weight"] == "row"
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "row"
    assert kinds["model.embed_tokens.weight"] is None and kinds["model.norm.weight"] is None


def test_tensor_parallelism_is_refused_for_a_model_without_a_plan():
    message = refusal("model=mlp", "data=dataset", "objective=classification", "plan.tp=2")
    assert "plan.tp=2" in message and "declares no tensor-parallel plan" in message


def test_a_model_with_too_few_outputs_for_the_data_is_refused():
    message = refusal("model=vit", "data=images", "objective=classification", "model.num_classes=5")
    assert "model.num_classes=5" in message and "needs 10 outputs" in message


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    tokenizer_dir = _tokenizer(tmp_path, vocabulary=300)
    corpus = tmp_path / "text.txt"
    corpus.write_text("some words and more words\n" * 2000)
    message = refusal("model=hf_causal_lm", "data=text", f"data.files=[{corpus}]", f"data.tokenizer={tokenizer_dir}",
                      "data.seq_len=32")
    assert "model.config.vocab_size=256" in message and "needs 300 outputs" in message


def _tokenizer(tmp_path, vocabulary: int) -> str:
    """A real Hugging Face tokenizer saved locally: a word-level vocabulary of the given size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocabulary - 3)}, "some": vocabulary - 3,
             "words": vocabulary - 2, "and": vocabulary - 1}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(directory)
    return str(directory)


# Bad data, refused before any worker starts.

def test_text_files_that_cannot_work_are_refused_naming_the_field(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "hello"}) + "\n")
    assert TextSource(files=[str(tmp_path / "none.txt")]).violations()[0].field == "data.files"
    assert "matches no file" in TextSource(files=[str(tmp_path / "*.parquet")]).violations()[0].message
    assert "is empty" in TextSource(files=[str(empty)]).violations()[0].message
    missing_field = TextSource(files=[str(rows)], text_field="text").violations()[0]
    assert missing_field.field == "data.text_field" and "body" in missing_field.message
    bad_tokenizer = TextSource(tokenizer=str(tmp_path / "no-tokenizer")).violations()[0]
    assert bad_tokenizer.field == "data.tokenizer" and "cannot be loaded" in bad_tokenizer.message
    assert "too little text" in TextSource(files=[str(rows)], text_field="body", seq_len=64).violations()[0].message
    rows.write_text(json.dumps({"text": "hello"}) + "\n\n" + json.dumps({"text": 5}) + "\n[1]\n")
    not_text = TextSource(files=[str(rows)]).violations()[0]
    assert not_text.message == "line 3 holds int '5', not text, in its 'text' field."
    rows.write_text(json.dumps({"text": "hello"}) + "\n[1]\n")
    assert TextSource(files=[str(rows)]).violations()[0].message == "line 2 is a JSON list, not an object."
    # A cache that could not be written would fail in every worker: refused here (even for root).
    uncached = TextSource(cache_dir="/proc/orch-text").violations()[0]
    assert uncached.field == "data.cache_dir" and uncached.message.startswith(
        "the tokenized files cannot be cached there: its closest existing parent /proc is a directory"), uncached


def test_files_that_fail_far_in_are_refused_before_any_worker_naming_the_file_and_line(tmp_path):
    """Files whose first rows are fine: the tokenizer would fail in the workers (exit 1, a
    traceback); pickled weights would be unpickled there. `orch` refuses each up front, exit 2."""


    def orch(*args):
        return orch_run([*args], cwd=tmp_path, timeout=300)

    lines = ["ASCII only, as far as the first rows go\n"] * 3000
    (tmp_path / "notes.txt").write_bytes("".join(lines).encode() + "caf\xe9 au lait\n".encode("latin-1"))
    rows = [json.dumps({"text": "a row with text " * 4})] * 3000 + [json.dumps({"body": "no text"})]
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n")
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    (tmp_path / "pretrained").mkdir()
    config.save_pretrained(tmp_path / "pretrained")
    torch.save(AutoModelForCausalLM.from_config(config).state_dict(), tmp_path / "pretrained" / "pytorch_model.bin")
    # `orch check` runs the checks `orch train` runs before it starts any worker.
    latin = orch("check", "data=text", "data.files=[notes.txt]")
    assert latin.returncode == 2, latin.stderr[-3000:]
    assert "data.files='notes.txt': line 3001 is not UTF-8 (byte 0xe9 at column 4" in latin.stderr, latin.stderr
    for data in (["data=text", "data.files=[rows.jsonl]"], ["data=ray", "data.paths=[rows.jsonl]"]):
        done = orch("check", *data)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "='rows.jsonl': line 3001 has no 'text' field (data.text_field; it has: body)" in done.stderr, data
    pickled = orch("check", "model=hf_causal_lm", "model.config=null", "model.pretrained_path=pretrained")
    assert pickled.returncode == 2, pickled.stderr[-3000:]
    assert ("model.pretrained_path='pretrained': " in pickled.stderr
            and "holds pickled weights (pytorch_model.bin), which are never loaded" in pickled.stderr), pickled.stderr


def test_text_is_tokenized_once_into_a_shared_cache_and_windows_cover_it(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"line {i} of some text"}) + "\n" for i in range(400)))
    source = TextSource(files=[str(rows)], seq_len=16, cache_dir=str(tmp_path / "cache"),
                        tokenizer=_tokenizer(tmp_path, vocabulary=50))
    source.prepare()
    stamp = next((tmp_path / "cache").glob("*/done")).stat().st_mtime_ns
    again = TextSource(files=[str(rows)], seq_len=16, cache_dir=str(tmp_path / "cache"),
                       tokenizer=source.tokenizer)
    again.prepare()
    assert next((tmp_path / "cache").glob("*/done")).stat().st_mtime_ns == stamp  # reused, not rebuilt
    train, val = again.datasets()
    inputs, targets = train[0]
    assert inputs.shape == targets.shape == (16,) and torch.equal(inputs[1:], targets[:-1])
    assert len(train) > len(val) > 0
    assert again.describe()["digest"] == source.describe()["digest"]
    assert not list((tmp_path / "cache").glob("*.lock"))
    # A tokenization that fails (here its file went away after the check) leaves nothing behind.
    gone = TextSource(files=[str(rows)], seq_len=8, cache_dir=str(tmp_path / "failed"))
    assert gone.violations() == [] and gone._cache_path
    rows.unlink()
    with pytest.raises(FileNotFoundError):
        gone.prepare()
    assert list((tmp_path / "failed").iterdir()) == []
    # Two data-parallel replicas read disjoint shards that cover the training windows.
    seen = [set(torch.utils.data.DistributedSampler(train, num_replicas=2, rank=r, shuffle=True, seed=1,
                                                    drop_last=True)) for r in (0, 1)]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) >= len(train) - 1


def test_image_folders_that_cannot_work_are_refused(tmp_path):
    from PIL import Image

    assert ImageSource(path=str(tmp_path / "none")).violations()[0].field == "data.path"
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "cat" / f"{i}.png")
    assert "hold no images" in ImageSource(path=str(tmp_path)).violations()[0].message
    (tmp_path / "dog" / "bad.png").write_bytes(b"not an image at all")
    unreadable = ImageSource(path=str(tmp_path)).violations()
    assert unreadable[0].value.endswith("bad.png") and "not a readable image" in unreadable[0].message
    (tmp_path / "dog" / "bad.png").unlink()
    Image.new("RGB", (8, 8)).save(tmp_path / "dog" / "0.png")
    classes = ImageSource(path=str(tmp_path), num_classes=1, val_fraction=0.25).violations()
    assert classes[0].field == "data.num_classes" and "labels would reach 1" in classes[0].message
    good = ImageSource(path=str(tmp_path), image_size=16, val_fraction=0.25)
    assert good.violations() == [] and good.required_outputs == 2
    image, label = good.datasets()[0][0]
    assert image.shape == (3, 16, 16) and label.item() in (0, 1)


def test_the_bundled_digits_need_no_download():
    train, val = ImageSource(image_size=32, channels=3).datasets()
    image, label = train[0]
    assert image.shape == (3, 32, 32) and 0 <= label.item() < 10
    assert len(train) + len(val) == 1797 and len(val) == 179


def test_a_users_dataset_that_cannot_work_is_refused(tmp_path):
    broken = DatasetSource(dataset={"_target_": "orch.workloads.dataset.GaussianBlobs", "samples": -3})
    assert broken.violations()[0].field == "data.dataset" and "could not be built" in broken.violations()[0].message
    missing = DatasetSource(dataset={"_target_": "no_such_module.Data"})
    assert missing.violations()[0].field == "data.dataset"
    tiny = DatasetSource(dataset={"_target_": "orch.workloads.dataset.GaussianBlobs", "samples": 4})
    assert "each part needs 8" in tiny.violations(8)[0].message
    ok = DatasetSource(dataset={"_target_": "orch.workloads.dataset.GaussianBlobs", "samples": 100})
    assert ok.violations() == [] and ok.example_batch(3)[0].shape == (3, 16)


FULL_SIZE = {
    "vit_b_16": ["experiment=vit_zero3_bf16", "model.patch_size=16", "model.num_layers=12", "model.num_heads=12",
                 "model.hidden_dim=768", "model.mlp_dim=3072", "model.num_classes=1000", "data.image_size=224"],
    "resnet50": ["experiment=resnet50_bf16", "model.num_classes=1000", "data.image_size=224"],
    "llama_7b": ["experiment=llama_text", "model.config.hidden_size=4096", "model.config.intermediate_size=11008",
                 "model.config.num_hidden_layers=32", "model.config.num_attention_heads=32",
                 "model.config.num_key_value_heads=32", "model.config.vocab_size=32000",
                 "model.config.tie_word_embeddings=false"],
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_the_experiments_full_size_counterparts_are_planned_for_a_gpu_cluster(name):
    """The `orch check` commands the experiment files document, at the models' published sizes
    (torchvision's model cards for ViT-B/16 and ResNet-50, Llama 2 7B's parameter count)."""
    estimate, facts = check(*FULL_SIZE[name], "cluster=a100_8x")
    expected = {"vit_b_16": 86_567_656, "resnet50": 25_557_032, "llama_7b": 6_738_415_616}[name]
    assert facts.param_count == expected and estimate.feasible


def test_orch_export_needs_a_run_and_refuses_an_unknown_one(tmp_path):


    def orch(*args):
        return orch_run([*args], cwd=tmp_path, timeout=120)

    missing = orch("export")
    assert missing.returncode == 2 and "orch export needs a run id" in missing.stderr
    unknown = orch("export", "0123456789abcdef", f"tracking.uri=sqlite:///{tmp_path / 'none.db'}")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr, unknown.stderr
    # --out naming a file is refused at once, before any run is read (it used to fail late, inside).
    (tmp_path / "notes.txt").write_text("mine")
    for command in ("export", "report"):
        into_a_file = orch(command, "0123456789abcdef", "--out", "notes.txt")
        assert into_a_file.returncode == 2, into_a_file.stderr
        assert "--out='notes.txt': is an existing file" in into_a_file.stderr
        # ... and so is one nothing can be created in, even by root.
        nowhere = orch(command, "0123456789abcdef", "--out", "/proc/orch-out")
        assert nowhere.returncode == 2 and "Traceback" not in nowhere.stderr, nowhere.stderr
        assert (f"--out='/proc/orch-out': orch {command} cannot write there: its closest existing parent /proc is a "
                "directory this user cannot create files in") in nowhere.stderr, nowhere.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


# Building the model: host memory before the first step.

def test_building_llama_7b_whole_on_every_worker_is_refused_on_small_hosts_and_zero3_fixes_it():
    """8 workers each building Llama 2 7B whole in fp32 need 8 x 25.1 GiB of host memory at once;
    under ZeRO-3 each builds its eighth inside deepspeed.zero.Init."""
    small_hosts = [*FULL_SIZE["llama_7b"], "cluster=a100_8x", "cluster.host_memory_gib=128"]
    estimate, facts = check(*small_hosts)
    fp32 = facts.param_count * 4
    assert estimate.build.how == "whole" and 0 <= estimate.build.model - fp32 < 2**20, "fp32 parameters and buffers"
    assert estimate.build.total == 8 * estimate.build.model
    [violation] = [v for v in estimate.violations if v.field == "cluster.host_memory_gib"]
    assert "8 worker(s) each hold the model as built (whole: 25.10 GiB)" in violation.message
    assert "plan.zero_stage=3" in violation.fix
    sharded, _ = check(*small_hosts, "plan.zero_stage=3")
    assert sharded.build.how == "zero.Init share"
    assert sharded.build.model == -(-estimate.build.model // sharded.plan.dp)
    assert not [v for v in sharded.violations if v.field == "cluster.host_memory_gib"]


def test_each_pipeline_stage_builds_only_its_own_layers():
    estimate, _ = check("model.n_layer=4", "plan.dp=1", "plan.pp=2", "plan.grad_accum_steps=2")
    per_param = estimate.model.built_bytes / estimate.model.param_count
    assert estimate.build.how == "pipeline stage"
    assert estimate.build.model == round(max(s.params for s in estimate.pipeline) * per_param)
    assert estimate.build.model < estimate.model.built_bytes


def test_weight_files_a_model_loads_count_towards_building_it(tmp_path):
    """A save_pretrained directory's weights are held beside the model while they load."""
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    weights = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    estimate, _ = check("experiment=llama_text", "model.config=null", f"model.pretrained_path={tmp_path}")
    assert weights > 0 and estimate.build.weights == weights
    assert estimate.build.per_worker == estimate.model.built_bytes + weights


def test_a_model_without_its_own_plan_gets_deepspeeds_autotp_preset():
    """BLOOM declares no tensor-parallel plan in transformers; DeepSpeed ships a preset for it."""
    # Bloom's config maps the Llama experiment's size names (num_hidden_layers, ...) onto its own.
    bloom = ["experiment=llama_text", "model.config.model_type=bloom", "plan.dp=1", "cluster.devices_per_node=1"]
    typed, model_cfg, _ = to_typed(compose_config(*bloom))
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    assert workload.tp_specs_source == "DeepSpeed's AutoTP preset 'bloom'"
    assert {spec["partition_type"] for spec in workload.tp_layer_specs} == {"row", "column"}
    whole, _ = check(*bloom)
    split, _ = check(*bloom, "plan.tp=2", "cluster.devices_per_node=2")
    assert split.feasible and split.per_device.params < whole.per_device.params


def test_torchvision_blocks_are_checkpointed_with_the_same_gradients():
    """torchvision models have no checkpointing switch: their repeated blocks are wrapped, names unchanged."""
    import torchvision

    assert {type(u).__name__ for u in checkpoint_units(torchvision.models.vit_b_16())} == {"EncoderBlock"}
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    recomputed = torchvision.models.resnet18(num_classes=10)
    recomputed.load_state_dict(plain.state_dict())
    enable_activation_checkpointing(recomputed)
    assert len(checkpoint_units(recomputed)) == 8  # 4 stages x 2 basic blocks
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in recomputed.named_parameters()]
    images = torch.randn(2, 3, 32, 32)
    for model in (plain, recomputed):
        model.eval()  # batch norm's running statistics would see the recomputed forward twice
        model(images).square().sum().backward()
    torch.testing.assert_close(recomputed.conv1.weight.grad, plain.conv1.weight.grad)


def test_a_worker_refuses_to_build_whole_what_zero_init_could_not_build_when_memory_is_short(monkeypatch):
    """The planner counted a zero.Init share; the whole model must fit the worker's share of free memory."""
    from types import SimpleNamespace

    from orch.launchers.engines.deepspeed.building import refuse_whole_build_beyond_memory

    job = SimpleNamespace(workload=SimpleNamespace(
        model_factory=lambda: torch.nn.Linear(4096, 4096), model_config={"_target_": "torch.nn.Linear"}))
    refuse_whole_build_beyond_memory(job, "zero.Init failed: TypeError")  # 64 MiB: fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2**40))  # a share of a few bytes
    with pytest.raises(RuntimeError, match=r"torch.nn.Linear cannot be built under deepspeed.zero.Init "
                                           r"\(zero.Init failed: TypeError\), and building it whole takes 0.06 GiB"):
        refuse_whole_build_beyond_memory(job, "zero.Init failed: TypeError")


# Lineage: what a run records of its data.

def test_the_same_data_gives_the_same_digest_wherever_it_lies(tmp_path, monkeypatch):
    from orch.workloads import lineage
    from orch.workloads.corpus import CorpusSource

    text = b"some training text\n" * 5000
    (tmp_path / "a.txt").write_bytes(text)
    (tmp_path / "b.txt").write_bytes(text)
    (tmp_path / "c.txt").write_bytes(text.replace(b"some", b"more"))
    a, b, c = (CorpusSource(path=str(tmp_path / f"{n}.txt")).describe() for n in "abc")
    assert a["digest"] == b["digest"] != c["digest"] and a["size"] == len(text) and a["unit"] == "bytes"
    assert a["source"] == str(tmp_path / "a.txt")
    # Large files are named by their size and evenly spaced chunks, still from their content.
    monkeypatch.setattr(lineage, "WHOLE_FILE_LIMIT", 1024)
    monkeypatch.setattr(lineage, "CHUNK", 512)
    assert lineage.files_digest([tmp_path / "a.txt"]) == lineage.files_digest([tmp_path / "b.txt"])
    assert lineage.files_digest([tmp_path / "a.txt"])[0] != lineage.files_digest([tmp_path / "c.txt"])[0]
    # Python datasets by their arguments, length and sampled items; the bundled digits by their arrays.
    blobs = [DatasetSource(dataset={"_target_": "orch.workloads.dataset.GaussianBlobs", "seed": s}).describe()
             for s in (0, 0, 1)]
    assert blobs[0]["digest"] == blobs[1]["digest"] != blobs[2]["digest"] and blobs[0]["unit"] == "samples"
    digits = ImageSource(path=None).describe()
    assert digits["size"] == 1797 and digits["digest"] == ImageSource(path=None).describe()["digest"]


def test_a_description_becomes_an_mlflow_dataset_with_its_source_kind():
    from orch.tracking.store import dataset_entity

    local = dataset_entity({"name": "corpus", "source": "/data/corpus.txt", "size": 10, "unit": "bytes",
                            "digest": "ab" * 32})
    assert (local.source_type, json.loads(local.source), local.digest) == ("local", {"uri": "/data/corpus.txt"},
                                                                           "ab" * 8)
    assert json.loads(local.profile) == {"size": 10, "unit": "bytes"}
    code = dataset_entity({"source": "mypkg.MyDataset", "size": 3, "digest": "cd" * 32})
    assert code.source_type == "code" and code.name == "data"


def test_multihead_attention_is_measured_on_meta_as_it_runs_on_cpu():
    """nn.MultiheadAttention calls SDPA from inside torch's own Python: on meta it must take the
    CPU flash kernel too, not the math path that saves every attention matrix."""
    from orch.launchers.memory_probe import PeakMemoryTracker, live_tensor_bytes
    from orch.plans.memory.activations import measure_activations

    typed, model_cfg, _ = to_typed(compose_config("experiment=vit_zero3_bf16"))
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    predicted = measure_activations(workload.model_factory, micro_batch_size=8, inputs=workload,
                                    dtype=torch.bfloat16, checkpointing=False)
    torch.manual_seed(0)
    model = workload.model_factory().to(torch.bfloat16).train()
    train, _ = workload.data.datasets()
    batch = move_batch(torch.utils.data.default_collate([train[i] for i in range(8)]), "cpu", torch.bfloat16)
    baseline = live_tensor_bytes()
    with PeakMemoryTracker() as tracker:
        workload.loss(model, batch).backward()
    measured = tracker.peak - baseline
    assert abs(predicted.backward_peak_with_grads - measured) / measured < 0.05


def test_every_shipped_source_built_from_its_schema_alone_gets_the_schemas_defaults():
    """The schema states each default once; a source class restating one could drift from it."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from orch.workloads.ray_data import RayDataConfig
    from orch.workloads.schemas import CorpusDataConfig, DatasetDataConfig, ImagesDataConfig, TextDataConfig

    for schema in (CorpusDataConfig, ImagesDataConfig, TextDataConfig, RayDataConfig, DatasetDataConfig):
        declared = OmegaConf.structured(schema)
        arguments = ({"dataset": {"_target_": "orch.workloads.dataset.GaussianBlobs"}}
                     if schema is DatasetDataConfig else {})
        source = instantiate(OmegaConf.merge(declared, arguments), _convert_="all")
        for name, value in OmegaConf.to_container(declared).items():
            if name in ("_target_", *arguments):
                continue
            built = getattr(source, "collate_config" if name == "collate" else name)
            assert built == value, f"{schema.__name__}.{name}: the source holds {built!r}, the schema {value!r}"


def test_a_source_field_named_unlike_its_schema_is_refused_naming_the_schema_fields():
    from orch.workloads.schemas import CorpusDataConfig, from_schema

    with pytest.raises(TypeError, match=r"CorpusDataConfig has no field 'seqlen'.*path, seq_len, val_fraction"):
        from_schema(CorpusDataConfig, "seqlen")
