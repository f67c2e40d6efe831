"""data=ray: files or URIs streamed through Ray Data to the replicas.

The checks in milliseconds first (bad paths, fields and columns refused before Ray starts, the
planner's batch shapes, stable digests); then the source read by a real Ray in this process
(samples of every kind, the held-out split, epochs); then real DeepSpeed runs in Ray actors: two
replicas reading parquet from a loopback S3 server with disjoint and complete coverage and a
resume from the bucket, and a tensor x pipeline grid whose four ranks share one replica's batches.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from helpers.config import compose_config
from helpers.ray_cluster import ray_with_env
from orch.config import to_typed
from orch.launchers.batches import StreamedBatches
from orch.workloads.corpus import SHIPPED_CORPUS
from orch.workloads.objectives import Classification
from orch.workloads.ray_data import RayDataSource

ROWS_PER_REPLICA = 24  # 6 micro-batches of 4: one epoch is 6 steps at dp=2


def write_rows(root: Path, files: int, rows_per_file: int, start: int = 0) -> None:
    """Parquet files of ``x`` (8 floats), ``labels`` (4 classes) and a unique ``row`` id."""
    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(start)
    for f in range(files):
        ids = list(range(start + f * rows_per_file, start + (f + 1) * rows_per_file))
        pq.write_table(pa.table({"x": torch.randn(len(ids), 8, generator=generator).tolist(),
                                 "labels": [i % 4 for i in ids], "row": ids}), root / f"part{f}.parquet")


def write_text(root: Path, files: int = 3, lines: int = 1500) -> None:
    root.mkdir(parents=True, exist_ok=True)
    text = gzip.open(SHIPPED_CORPUS, "rt").read().splitlines()
    for f in range(files):
        pq.write_table(pa.table({"body": text[f * lines:(f + 1) * lines]}), root / f"part{f}.parquet")


# --- checked before anything starts --------------------------------------------------------------


def test_bad_declarations_are_refused_with_the_field_and_the_fix(tmp_path):
    from PIL import Image

    write_rows(tmp_path / "rows", 1, 8)
    write_text(tmp_path / "text", files=1, lines=400)

    def problem(**kw):
        found = RayDataSource(**kw).violations()
        assert len(found) == 1, found
        return found[0].field, found[0].message

    assert problem(paths=[]) == ("data.paths", "names nothing to read.")
    assert problem(paths=[str(tmp_path / "nowhere")])[0] == "data.paths"
    assert problem(paths=[str(tmp_path / "rows")], sample="pixels")[0] == "data.sample"
    field, why = problem(paths=[str(tmp_path / "text")], text_field="text")
    assert field == "data.text_field" and "(it has: body)" in why
    field, why = problem(paths=[str(tmp_path / "rows")], sample="columns", columns=["x", "row"], label_column="y")
    assert field == "data.label_column" and "x, labels, row" in why
    assert problem(paths=[str(tmp_path / "rows")], sample="images") == (
        "data.paths", "matches no image file (.png, .jpg, .jpeg, .bmp, .gif, .webp, .tif, .tiff).")
    assert problem(paths=[str(tmp_path / "rows")], sample="tokens", format="images")[0] == "data.sample"
    assert problem(paths=["s3://key:secret@bucket/data/"], format="parquet")[0] == "data.paths"
    assert problem(paths=[str(tmp_path / "rows")], val_paths=["s3://key:secret@bucket/val/"])[0] == "data.val_paths"
    (tmp_path / "one_class" / "cat").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "one_class" / "cat" / "0.png")
    field, why = problem(paths=[str(tmp_path / "one_class")], sample="images")
    assert field == "data.paths" and "1 class" in why
    field, why = problem(paths=[str(tmp_path / "text")], text_field="body", seq_len=4096)
    assert field == "data.paths" and "too little text" in why
    assert RayDataSource(paths=[str(tmp_path / "text")], text_field="body").violations() == []


def test_the_planner_sees_the_batch_the_stream_gives_and_digests_are_stable(tmp_path):
    write_rows(tmp_path / "rows", 2, 8)
    source = RayDataSource(paths=[str(tmp_path / "rows")], sample="columns", columns=["x", "row"],
                           label_column="labels")
    assert source.read_format == "parquet"  # from the directory's first file
    batch = source.example_batch(4)
    assert {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in batch.items()} == {
        "x": ((4, 8), torch.float32, "meta"), "row": ((4,), torch.long, "meta"), "labels": ((4,), torch.long, "meta")}
    assert source.sizes() == (16 - int(16 * 0.05), int(16 * 0.05))
    first = RayDataSource(paths=[str(tmp_path / "rows")]).describe()
    assert first["digest"] == RayDataSource(paths=[str(tmp_path / "rows")]).describe()["digest"]
    assert first["files"] == 2 and first["size"] == sum(p.stat().st_size for p in (tmp_path / "rows").iterdir())
    write_rows(tmp_path / "rows", 3, 8)
    assert RayDataSource(paths=[str(tmp_path / "rows")]).describe()["digest"] != first["digest"]


# --- read by a real Ray in this process ----------------------------------------------------------


@pytest.fixture(scope="module")
def data_ray(s3_store):
    """Ray started where the store's variables are set (its tasks read the bucket with them), with
    a CPU beside the 2 workers' for the data's tasks, as `orch` starts an embedded Ray."""
    with ray_with_env(s3_store["env"], num_cpus=3):
        yield


def passes(stream, source: RayDataSource, count: int) -> list[list]:
    """The samples of ``count`` passes over one replica's stream, read as a worker reads it: one
    :class:`StreamedBatches`, epoch after epoch."""
    batches = StreamedBatches(stream, batch_size=1, seed=0, to_batch=source.to_batch())
    found: list[list] = [[]]
    while True:
        sample = next(batches)
        if batches.epoch == len(found):  # the first sample of the next pass
            if len(found) == count:
                return found
            found.append([])
        found[-1].append(sample)


def test_held_out_rows_are_the_same_every_pass_and_never_trained_on(data_ray, tmp_path):
    write_rows(tmp_path / "rows", 4, 20)
    source = RayDataSource(paths=[str(tmp_path / "rows")], sample="columns", columns=["x", "row"],
                           label_column="labels", val_fraction=0.25)
    train_stream, val_stream = source.streams(1, eval_samples=10**6)[0]
    [train] = passes(train_stream, source, 1)
    # Every evaluation of an attempt passes over the same held-out stream again.
    val, again = ([int(b["row"]) for b in samples] for samples in passes(val_stream, source, 2))
    train = sorted(int(b["row"]) for b in train)
    assert not set(train) & set(val) and sorted(train + val) == list(range(80))
    assert 8 <= len(val) <= 35  # a quarter of the rows by hash, not by position
    assert again == val
    # The evaluation set is the split's first samples in file order: a later attempt (a restart
    # makes its streams again) reads the same ones.
    (_, short), = source.streams(1, eval_samples=5)
    first, second = ([int(b["row"]) for b in samples] for samples in passes(short, source, 2))
    assert first == second == val[:5]


def test_images_and_token_windows_stream_as_the_objectives_take_them(data_ray, tmp_path):
    from PIL import Image

    for label, colour in enumerate(["red", "green", "blue"]):
        (tmp_path / "img" / f"class_{label}").mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (20 + i, 12), colour).save(tmp_path / "img" / f"class_{label}" / f"{i}.png")
    images = RayDataSource(paths=[str(tmp_path / "img")], sample="images", image_size=16, val_fraction=0.3)
    assert images.violations() == [] and images.required_outputs == 3
    (train, _), = images.streams(1, eval_samples=10**6)
    batches = StreamedBatches(train, batch_size=4, seed=0, to_batch=images.to_batch(), shuffle_buffer=8)
    x, labels = next(batches)
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and -1 <= x.min() <= x.max() <= 1
    assert labels.dtype == torch.long and set(labels.tolist()) <= {0, 1, 2}
    # A red image is class 0, whatever order the stream gave it in.
    for image, label in zip(x, labels, strict=True):
        assert int(image.mean(dim=(1, 2)).argmax()) == int(label)
    logits = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 3))(x)
    assert torch.isfinite(Classification()(logits, (x, labels)))

    write_text(tmp_path / "text", files=2, lines=40)
    text = RayDataSource(paths=[str(tmp_path / "text")], text_field="body", seq_len=16)
    (train, _), = text.streams(1, eval_samples=10**6)
    [windows] = passes(train, text, 1)
    inputs, targets = windows[0]
    assert inputs.shape == (1, 16) and torch.equal(inputs[0, 1:], targets[0, :-1])
    assert text.required_outputs == 256 and int(max(w[0].max() for w in windows)) < 256


def test_epochs_count_passes_and_a_resume_restarts_the_saved_epoch(data_ray, tmp_path):
    write_rows(tmp_path / "rows", 1, 12)
    source = RayDataSource(paths=[str(tmp_path / "rows")], sample="columns", val_paths=[str(tmp_path / "rows")])
    (train, _), = source.streams(1, eval_samples=10**6)
    batches = StreamedBatches(train, batch_size=4, seed=0, to_batch=source.to_batch())
    seen = [sorted(next(batches)["row"].tolist()) for _ in range(4)]
    assert batches.state_dict() == {"epoch": 1, "position": 1}
    assert sorted(sum(seen[:3], [])) == list(range(12))  # one pass is every row once
    batches.load_state_dict({"epoch": 1, "position": 1})
    again = [sorted(next(batches)["row"].tolist()) for _ in range(3)]
    assert sorted(sum(again, [])) == list(range(12)) and batches.state_dict() == {"epoch": 1, "position": 3}


# --- real runs -------------------------------------------------------------------------------------


def train(sqlite_uri: str, *overrides: str):
    from orch.run.driver import run_training

    cfg = compose_config("train.log_every=2", "train.eval_batches=1", "plan.micro_batch_size=4",
                         f"tracking.uri={sqlite_uri}", *overrides)
    return run_training(*to_typed(cfg))


@pytest.mark.slow
def test_two_replicas_cover_parquet_in_the_bucket_disjointly_and_resume_at_the_epoch(data_ray, s3_store,
                                                                                      sqlite_uri, tmp_path):
    client, bucket = s3_store["client"], s3_store["bucket"]
    write_rows(tmp_path / "train", 3, 2 * ROWS_PER_REPLICA // 3)
    write_rows(tmp_path / "val", 1, 16, start=1000)
    for split in ("train", "val"):
        for part in (tmp_path / split).iterdir():
            client.upload_file(str(part), bucket, f"rows/{split}/{part.name}")
    record = tmp_path / "record"
    record.mkdir()
    run = ["data=ray", f"data.paths=[s3://{bucket}/rows/train/]", f"data.val_paths=[s3://{bucket}/rows/val/]",
           "data.sample=columns", "data.columns=[x,row]", "data.label_column=labels", "objective=classification",
           "model=mlp", "model._target_=recording_models.RowRecorder", "model.in_channels=8",
           f"+model.record_dir={record}", "plan.dp=2", "train.checkpoint_every=8",
           f"train.checkpoint_dir=s3://{bucket}/rows-run", "train.resume=auto"]
    first = train(sqlite_uri, *run, "train.steps=8")
    assert [(r[0].step, r[0].epoch) for r in first.reports] == [(2, 0), (4, 0), (6, 0), (8, 1)]
    rows = {}
    for path in record.iterdir():
        rows[path.name.split("-")[0]] = [int(r) for line in path.read_text().split("\n") if line
                                         for r in line.split()]
    assert sorted(rows) == ["rank0", "rank1"]
    epoch0 = [rows[rank][:ROWS_PER_REPLICA] for rank in ("rank0", "rank1")]
    assert not set(epoch0[0]) & set(epoch0[1])  # each replica its own shard
    assert sorted(epoch0[0] + epoch0[1]) == list(range(2 * ROWS_PER_REPLICA))  # and together all of it
    assert all(len(rows[rank]) == 8 * 4 for rank in rows)
    assert first.reports[-1][0].evaluation["eval_loss"] > 0

    # Resumed from the bucket, rank 1 dies (SIGKILL) in its second batch, step 10, before any
    # report or checkpoint of this run: the group restarts from step 8 with its streams and its
    # evaluation set made afresh, while the dead attempt's are torn down.
    (record / "kill-rank1-at-batch-2").touch()
    resumed = train(sqlite_uri, *run, "train.steps=14", "train.max_failures=1")
    assert resumed.run_id == first.run_id and not (record / "kill-rank1-at-batch-2").exists()
    assert [f.start_step for f in resumed.worker_facts] == [8, 8]
    assert [(r[0].step, r[0].epoch) for r in resumed.reports] == [(10, 1), (12, 1), (14, 1)]
    assert resumed.reports[-1][0].evaluation["eval_loss"] > 0


@pytest.mark.slow
def test_tensor_and_pipeline_ranks_of_one_replica_read_the_same_stream(data_ray, sqlite_uri, tmp_path):
    write_text(tmp_path / "text")
    result = train(sqlite_uri, "data=ray", f"data.paths=[{tmp_path / 'text'}]", "data.text_field=body",
                   "train.steps=6", "plan.dp=1", "plan.tp=2", "plan.pp=2", "plan.grad_accum_steps=2",
                   "cluster.devices_per_node=4", "cluster.cpus_per_worker=0.5")
    digests = {r.first_batch_digest for r in result.reports[0]}
    assert len(digests) == 1 and None not in digests  # all four ranks: the first stage's and the last's
    first, last = result.reports[0], result.reports[-1]
    assert last[0].loss < first[0].loss
    assert len({r.evaluation["eval_loss"] for r in last}) == 1
