"""Every configuration error names its key, before anything is created."""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import re
import subprocess
import sys
import tokenize
import typing
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, RunConfig, from_dict, load_config, save, to_dict
from hpcrl.model.tiny import TinyModelConfig, build_tiny_model
from hpcrl.submit import main as submit_main
from light import heavy_modules, light_command

QUICK = "configs/quickstart.yaml"


@pytest.mark.parametrize("override, key, allowed", [
    ("trainer.totl_steps=5", "trainer.totl_steps", "total_steps"),  # unknown key lists the allowed ones
    ("nonsense=1", "nonsense", "run_dir"),
    ("trainer.total_steps=abc", "trainer.total_steps", "integer"),
    ("trainer.total_steps=1.5", "trainer.total_steps", "integer"),
    ("trainer.lr=fast", "trainer.lr", "number"),
    ("trainer.lr=-1", "trainer.lr", "> 0"),
    ("rollout.kv_on_update=drop", "rollout.kv_on_update", "'recompute', 'keep'"),
    ("rollout.admit_min_free=500", "rollout.admit_min_free", "[0, max_batch_size=64]"),
    ("algo.adv_estimator=ppo2", "algo.adv_estimator", "'grpo'"),
    ("algo.loss_agg=mean", "algo.loss_agg", "token_mean"),
    ("launch.mode=turbo", "launch.mode", "'colocated'"),
    ("data.on_bad_row=ignore", "data.on_bad_row", "'skip'"),
    ("rollout.group_size=0", "rollout.group_size", ">= 1"),
    ("rollout.max_batch_size=4", "rollout.max_batch_size", "group_size"),
    ("admission.max_staleness=-1", "admission.max_staleness", ">= 0"),
    ("sft.enabled=maybe", "sft.enabled", "true or false"),
    ("reward.isolation=docker", "reward.isolation", "'process'"),
    ("trainer=3", "trainer", "section"),
    ("trainer.betas=0.9", "trainer.betas", "list"),
    ("weights.mode=ftp", "weights.mode", "'disk'"),
    ("trainer.lora.rank=-2", "trainer.lora.rank", ">= 0"),
    ("trainer.lora.dropout=0.1", "trainer.lora.dropout", "rank"),  # no adapter dropout (see trainer.md)
])
def test_bad_value_names_key(override: str, key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(QUICK, [override])
    msg = str(info.value)
    assert msg.startswith(key + ":") or msg.startswith(key + "."), msg
    assert allowed in msg, msg


def test_prox_approx_needs_decoupled_ppo() -> None:
    with pytest.raises(ConfigError, match=r"^algo\.prox_approx:.*decoupled=false"):
        load_config(QUICK, ["algo.prox_approx=true", "algo.decoupled=false"])


def test_agent_export_and_turn_discount() -> None:
    cfg = load_config(QUICK, ["agent.fn=examples.agents.feedback_arithmetic:run_agent_return_reward",
                              "agent.export=individual", "agent.turn_discount=0.9"])
    assert (cfg.agent.export, cfg.agent.turn_discount) == ("individual", 0.9)
    assert (load_config(QUICK).agent.export, load_config(QUICK).agent.turn_discount) == ("concat", 1.0)
    fn = "agent.fn=m:f"
    for override, message in [
        ("agent.export=separate", r"^agent\.export: .*'concat', 'individual'"),
        ("agent.turn_discount=1.5", r"^agent\.turn_discount: must be in \[0, 1\], got 1\.5"),
        ("agent.turn_discount=-0.1", r"^agent\.turn_discount: must be in \[0, 1\]"),
        ("agent.turn_discount=nan", r"^agent\.turn_discount: must be in \[0, 1\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(QUICK, [fn, "agent.export=individual", override])
    with pytest.raises(ConfigError, match=r"^agent\.turn_discount: discounts the turns of export=individual only"):
        load_config(QUICK, [fn, "agent.turn_discount=0.9"])  # a concat episode is one sample: nothing to discount
    with pytest.raises(ConfigError, match=r"^agent\.export: 'individual' exports agent episodes; set agent\.fn"):
        load_config(QUICK, ["agent.export=individual"])


def test_float16_is_refused_for_the_fsdp_trainer_and_bfloat16_accepted() -> None:
    assert load_config(QUICK, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"^model\.dtype: float16 training needs loss scaling"):
        load_config(QUICK, ["model.dtype=float16"])


def test_one_sampling_temperature_for_rollouts_and_trainer(tmp_path) -> None:
    cfg = load_config(QUICK, ["rollout.temperature=0.7"])  # the trainer scores with what the rollouts sample
    assert cfg.algo.temperature == cfg.rollout.temperature == 0.7
    save(cfg, tmp_path / "config.yaml")
    assert from_dict(to_dict(cfg)).algo.temperature == 0.7
    assert load_config(QUICK, ["rollout.temperature=0.7", "algo.temperature=0.7"]).algo.temperature == 0.7
    with pytest.raises(ConfigError, match=r"^algo\.temperature: 1\.0 differs from rollout\.temperature 0\.7"):
        load_config(QUICK, ["rollout.temperature=0.7", "algo.temperature=1.0"])
    with pytest.raises(ConfigError, match=r"^algo\.temperature:"):
        load_config(QUICK, ["algo.temperature=0.5"])  # set on the trainer's side alone: refused, not ignored


def test_missing_model_and_data_name_keys() -> None:
    with pytest.raises(ConfigError, match=r"^model\.path:"):
        load_config(None, ["data.synthetic=addition"])
    with pytest.raises(ConfigError, match=r"^data\.train_path:"):
        load_config(None, ["model.tiny=true"])


def test_override_syntax_and_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config(QUICK, ["trainer.total_steps"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_types_are_coerced_and_round_trip(tmp_path) -> None:
    cfg = load_config(QUICK, ["trainer.lr=5e-5", "trainer.total_steps=7", "algo.eps_clip_high=0.28",
                              "trainer.betas=[0.8,0.9]"])
    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.lr == 5e-5 and cfg.trainer.total_steps == 7
    assert cfg.algo.eps_clip_high == 0.28 and tuple(cfg.trainer.betas) == (0.8, 0.9)
    save(cfg, tmp_path / "config.yaml")
    from omegaconf import OmegaConf
    again = from_dict(OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml")))
    assert to_dict(again) == to_dict(cfg)


def test_submit_rejects_bad_config_before_creating_anything(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    code = submit_main(["--config", QUICK, f"run_dir={run_dir}", "trainer.lr=oops"])
    assert code == 2
    assert not run_dir.exists()
    assert "config error: trainer.lr:" in capsys.readouterr().err


def test_base_file_is_merged_under_the_preset(tmp_path) -> None:
    (tmp_path / "base.yaml").write_text("model: {tiny: true}\ndata: {synthetic: addition}\ntrainer: {lr: 0.001, total_steps: 9}\n")
    (tmp_path / "preset.yaml").write_text("base: base.yaml\ntrainer: {lr: 0.0005}\n")
    cfg = load_config(tmp_path / "preset.yaml", ["trainer.warmup_steps=1"])
    assert cfg.trainer.lr == 0.0005 and cfg.trainer.total_steps == 9 and cfg.trainer.warmup_steps == 1
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "loop.yaml")


def test_loading_a_config_imports_no_torch() -> None:
    """The supervisor, audit and tools load configs; that must stay cheap (no torch, numpy, transformers)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from hpcrl.config import load_config; load_config('configs/quickstart.yaml', []); "
            "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'h5py') if m in sys.modules))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_light_commands_import_neither_torch_nor_transformers() -> None:
    """``python -m hpcrl status|cancel``, the audit, the supervisor and ``hpcrl.submit`` (whose --dry-run and
    --resume run in the process that imports it) start without the heavy stack."""
    code = ("import sys; import hpcrl.__main__, hpcrl.audit, hpcrl.submit, hpcrl.launch.supervisor, "
            "hpcrl.launch.dry_run, hpcrl.launch.resume, hpcrl.init_from; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_dry_run_checks_model_and_data_and_creates_nothing(tmp_path) -> None:
    """``--dry-run`` prints each component's request and fails on a missing model or dataset, before anything
    exists: no run directory, no dataset, no model."""
    root = Path(__file__).resolve().parents[1]

    def dry(*overrides: str) -> subprocess.CompletedProcess:
        out = subprocess.run(light_command("hpcrl.submit", "--config", str(root / "configs/quickstart.yaml"),
                                           f"run_dir={tmp_path}/run", f"model.cache_dir={tmp_path}/models",
                                           f"data.synthetic_dir={tmp_path}/data", *overrides, "--dry-run"),
                             capture_output=True, text=True, timeout=120, cwd=root,
                             env={**os.environ, "PYTHONPATH": f"{root}:{root / 'tests'}"})
        assert heavy_modules(out.stderr) == []  # a light command, whatever it checks
        return out

    ok = dry("rollout.replicas=2")
    assert ok.returncode == 0, ok.stdout + ok.stderr[-2000:]
    lines = ok.stdout.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("[ok]")] == ["model:", "data:", "trainer-r0", "rollout-0",
                                                                         "rollout-1"]
    assert any("-m hpcrl.rollout --run-dir" in ln and "--replica 1" in ln for ln in lines), lines
    bad = dry("model.tiny=false", f"model.path={tmp_path}/nomodel", "data.synthetic=none",
              f"data.train_path={tmp_path}/train.jsonl", f"init.checkpoint={tmp_path}/gone")
    assert bad.returncode == 1, bad.stdout
    assert f"[FAIL] start: init.checkpoint: {tmp_path}/gone does not exist" in bad.stdout
    assert f"[FAIL] model: model.path: {tmp_path}/nomodel is not a directory" in bad.stdout
    assert f"[FAIL] data: data.train_path: {tmp_path}/train.jsonl does not exist" in bad.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created
    model = build_tiny_model(tmp_path / "model", TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2,
                                                                 num_kv_heads=2, head_dim=8, intermediate_size=32))
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    real = dry("model.tiny=false", f"model.path={model}", "data.synthetic=none",
               f"data.train_path={tmp_path}/train.jsonl")
    assert real.returncode == 0 and f"[ok] model: model {model} (tokenizer: " in real.stdout, real.stdout
    (model / "tokenizer.json").write_text("{broken")
    broken = dry("model.tiny=false", f"model.path={model}", "data.synthetic=none",
                 f"data.train_path={tmp_path}/train.jsonl")
    assert broken.returncode == 1 and "[FAIL] model: model.path: the tokenizer in" in broken.stdout, broken.stdout


def test_rewind_and_from_are_refused_where_they_do_not_apply(tmp_path, capsys) -> None:
    """--rewind needs --resume of a checkpoint directory; --from starts a new run, never a resumed one; a resume
    cannot change where a run started from."""
    run = tmp_path / "run"
    run.mkdir()
    save(load_config(QUICK, [f"run_dir={run}"]), run / "config.yaml")
    cases = [(["--config", QUICK, "--rewind"], "--rewind goes with --resume"),
             (["--resume", str(run), "--rewind"], "--rewind: name the checkpoint to go back to"),
             (["--resume", str(run), "--from", str(run)], "--from starts a new run"),
             (["--config", QUICK, "--restore", "data"], "--from starts a new run"),
             (["--resume", str(run), f"init.checkpoint={run}"], "--resume cannot change init.checkpoint")]
    for argv, message in cases:
        assert submit_main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv


# Keys read only through a property of their own config class (the property is what the code reads).
READ_THROUGH = {"algo.eps_clip_high": "clip_high"}


def config_keys(cls=RunConfig, prefix: str = ""):
    """(config class, dotted key, field name) of every leaf key of the run config."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from config_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield cls, prefix + f.name, f.name


def code_and_strings(text: str) -> tuple[str, set[str]]:
    """A module's code with comments and string literals blanked out, and the set of its string literals."""
    code, strings = [], set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            strings.add(tok.string.strip("\"'"))
        elif tok.type != tokenize.COMMENT:
            code.append(tok.string)
    return " ".join(code), strings


def test_every_config_key_is_read_somewhere() -> None:
    """A key that is defined, documented and validated but read by no component is a silent no-op. A key
    counts as read when code outside its own config module (comments and docstrings aside) accesses it:
    ``.name``, or the string ``"name"`` (getattr, dict keys); for names that are also methods of tensors,
    paths, strings or dicts (``size``, ``partition``) an access that is not a call, and for their other
    attributes (``dtype``, ``name``, ``device``) only the qualified ``section . name`` (``cfg.model.dtype``), or
    ``cfg.name`` in a file whose code names the whole key (``place(cfg.device, "rollout.device")``), since ``.dtype``
    alone is read everywhere."""
    import torch

    root = Path(__file__).resolve().parents[1] / "hpcrl"
    sources = {p.resolve(): code_and_strings(p.read_text()) for p in root.rglob("*.py")}
    types = (torch.Tensor, Path, str, dict)
    common = {name for t in types for name in dir(t)}
    methods = {name for t in types for name in dir(t) if callable(getattr(t, name, None))}
    unread = []
    for cls, key, name in config_keys():
        home = Path(inspect.getsourcefile(cls)).resolve()
        read, by_string, named = READ_THROUGH.get(key, name), False, None
        if "." not in key:  # a top-level key (run_dir, seed...): cfg.<name>
            pattern = re.compile(r"\bcfg \. " + re.escape(read) + r"\b")
        elif read in methods:  # .partition / .size: an access that is not a call
            pattern = re.compile(r"\. " + re.escape(read) + r"\b(?! \()")
        elif read in common:  # .dtype / .name: the qualified form, or `.name` in a file that names the whole key
            pattern = re.compile(r"\b" + re.escape(key.rsplit(".", 2)[-2]) + r" \. " + re.escape(read) + r"\b")
            named = re.compile(r"\bcfg \. " + re.escape(read) + r"\b")
        else:
            pattern, by_string = re.compile(r"\. " + re.escape(read) + r"\b"), True
        if not any(pattern.search(code) or (by_string and read in strings)
                   or (named is not None and key in strings and named.search(code))
                   for path, (code, strings) in sources.items() if path != home):
            unread.append(key)
    assert not unread, f"config keys no component reads: {unread}"


def test_published_lora_adapters_need_what_loads_them() -> None:
    lora = ["trainer.lora.rank=4", "trainer.lora.publish=adapter"]
    assert load_config(QUICK, [*lora, "rollout.engine=vllm"]).trainer.lora.publish == "adapter"
    for extra, message in [
        ([], r"^trainer\.lora\.publish: adapter publishes LoRA adapters; set trainer\.lora\.rank > 0"),
        (["weights.mode=collective"], r"^trainer\.lora\.publish: adapter does not work with weights\.mode=collective"),
        (["rollout.engine=sglang"], r"^trainer\.lora\.publish: adapter does not work with rollout\.engine=sglang"),
        (["launch.mode=colocated"], r"^trainer\.lora\.publish: adapter does not work with launch\.mode=colocated"),
        (["init.checkpoint=/some/run"], r"^trainer\.lora\.publish: adapter does not work with init\.checkpoint"),
        (["rollout.engine=vllm", "trainer.lora.rank=600"], r"^trainer\.lora\.publish: .*vLLM serves adapters up to"),
        (["trainer.engine=megatron"], r"^trainer\.lora\.rank: LoRA is not built for trainer\.engine=megatron"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(QUICK, [*(lora if extra else lora[1:]), *extra])
