"""The Hugging Face stack unmodified on ``neuron`` (issue 17): Trainer, Accelerate, TRL,
PEFT, Diffusers and safetensors detect the device as TorchNeuron (through the
``torch_neuronx`` compatibility module, device/torch_neuronx) and train with the numbers
of the same run on the CPU.

Every model is tiny and built from a config (no downloads), every data set is in
memory. Each scenario runs in strict and in adaptive eager (``any_mode``). The default
run holds all but Trainer with ``torch_compile=True`` (~40 s: Dynamo and AOTAutograd
compile the step), which carries the ``slow`` marker that setup.cfg's ``addopts``
deselects: ``python -m pytest -m slow tests/integrations/test_hf_stack.py`` runs it.

Needs the ``hf`` extra (``pip install -c constraints.txt -e ".[test,hf]"``); each test
skips, saying which library is missing, without it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_same  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def offline_and_quiet():
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    yield
    hf_logging.set_verbosity(verbosity)
    hf_logging.enable_progress_bar()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state (device, mixed precision): each run, the
    CPU one included, starts from none, as a fresh process would."""
    def reset():
        try:
            from accelerate.state import AcceleratorState, PartialState
        except ImportError:
            return
        AcceleratorState._reset_state(True)
        PartialState._reset_state()

    reset()
    yield
    reset()


VOCAB = 64


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def token_rows(n=16, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=g)


def tiny_tokenizer():
    """A word-level tokenizer over ``w3 .. w63`` built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                                bos_token="<s>")


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# -- detection ------------------------------------------------------------------------


def test_the_libraries_detect_the_device_as_torchneuron():
    """No configuration, no environment variable: transformers' and accelerate's
    TorchNeuron probes answer yes, and Trainer, Accelerate and TRL pick ``neuron``."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_neuron_available

    assert is_torch_neuron_available() and is_torch_neuron_available(check_device=True)
    assert is_torch_bf16_gpu_available()
    args = transformers.TrainingArguments(output_dir="unused", report_to=[])
    assert args.device == torch.device("neuron", 0)
    assert transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True).device.type == "cpu"
    assert transformers.TrainingArguments(output_dir="unused", report_to=[], torch_compile=True).torch_compile_backend == "neuron"

    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import is_neuron_available

    assert is_neuron_available() and is_neuron_available(check_device=True)
    assert accelerate.Accelerator().device.type == "neuron"


def test_trl_sft_config_defaults_on_the_device():
    """``SFTConfig()`` used to raise "Your setup doesn't support bf16/gpu": its bf16
    default now finds a bf16-capable accelerator, and its neuron padding default applies."""
    trl = pytest.importorskip("trl")
    config = trl.SFTConfig(output_dir="unused", report_to=[])
    assert config.device.type == "neuron"
    assert config.bf16 is True
    assert config.pad_to_multiple_of == 128  # TRL's default on a neuron device


def test_import_torch_does_not_load_the_compatibility_module():
    code = "import sys, torch; torch.ones(1, device='neuron'); print('torch_neuronx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "False"
    code = ("import importlib.util, torch_neuronx, torch; print(torch_neuronx.SIMULATED, torch_neuronx.is_available(), "
            "torch_neuronx.device_count(), importlib.util.find_spec('torch_neuronx').origin)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/",
                         env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    simulated, available, count, origin = out.stdout.split()
    assert (simulated, available, count) == ("True", "True", "1")  # importing it registers the device
    assert origin.endswith(os.path.join("device", "torch_neuronx", "__init__.py")) or "site-packages" in origin


def _fake_torchneuron(root, with_package=True):
    """A stand-in for ``pip install torch-neuronx``: its distribution metadata and,
    optionally, its ``torch_neuronx`` package (which says who it is)."""
    dist = root / "torch_neuronx-2.9.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.9.0\n")
    (dist / "top_level.txt").write_text("torch_neuronx\n")
    if with_package:
        (root / "torch_neuronx").mkdir()
        (root / "torch_neuronx" / "__init__.py").write_text("REAL = True\n")


def _import_our_shim_as_torch_neuronx(extra_path):
    """Import device/torch_neuronx under its installed name, as a non-editable install
    (or one later on sys.path than the real package) would, with ``extra_path`` on sys.path."""
    import adaptive_eager_device

    shim = os.path.join(os.path.dirname(adaptive_eager_device.__file__), "torch_neuronx", "__init__.py")
    return textwrap.dedent(f"""
        import importlib.util, sys, warnings
        sys.path.append({str(extra_path)!r})
        spec = importlib.util.spec_from_file_location("torch_neuronx", {shim!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules["torch_neuronx"] = module
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                spec.loader.exec_module(module)
            except ImportError as error:
                print("ImportError", error)
                raise SystemExit(0)
        import torch_neuronx
        print(getattr(torch_neuronx, "REAL", False), [str(w.message) for w in caught if w.category is RuntimeWarning])
    """)


def test_a_real_torchneuron_wins(tmp_path):
    """Where another distribution provides ``torch_neuronx``, ours never shadows it: on
    sys.path it is found first (the editable finder comes after Python's path finder);
    where ours is imported anyway, it warns and loads the other one in its place, or, when
    there is no other one to load (two installs wrote one folder), refuses to import."""
    _fake_torchneuron(tmp_path / "real")
    out = subprocess.run([sys.executable, "-c", "import torch_neuronx; print(getattr(torch_neuronx, 'REAL', False))"],
                         capture_output=True, text=True, check=True, cwd="/",
                         env=dict(os.environ, PYTHONPATH=str(tmp_path / "real")))
    assert out.stdout.strip() == "True"

    out = subprocess.run([sys.executable, "-c", _import_our_shim_as_torch_neuronx(tmp_path / "real")],
                         capture_output=True, text=True, check=True, cwd="/")
    real, warned = out.stdout.split(" ", 1)
    assert real == "True", out.stdout + out.stderr
    assert "torch-neuronx 2.9.0 is installed" in warned and "steps aside" in warned

    _fake_torchneuron(tmp_path / "clobbered", with_package=False)
    out = subprocess.run([sys.executable, "-c", _import_our_shim_as_torch_neuronx(tmp_path / "clobbered")],
                         capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.startswith("ImportError torch_neuronx: torch-neuronx 2.9.0 is installed"), out.stdout + out.stderr

    out = subprocess.run([sys.executable, "-c", _import_our_shim_as_torch_neuronx(tmp_path / "nothing")],
                         capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "False []"  # alone, it is the shim, silently


# -- Trainer ----------------------------------------------------------------------------


def train_causal_lm(use_cpu, steps=4, **extra):
    model = tiny_llama()
    data = [{"input_ids": row, "labels": row} for row in token_rows()]
    args = transformers.TrainingArguments(
        output_dir="unused", use_cpu=use_cpu, max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
        learning_rate=1e-3, report_to=[], save_strategy="no", seed=0, disable_tqdm=True, **extra)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer, model


def test_trainer_matches_the_cpu_loss_log(any_mode):
    """A few Trainer steps (AdamW, linear schedule, gradient clipping, pinned-memory
    dataloader: Trainer's defaults) on ``neuron``, found with no configuration, against
    the ``use_cpu=True`` run."""
    cpu, cpu_model = train_causal_lm(use_cpu=True)
    neuron, model = train_causal_lm(use_cpu=False)
    assert next(model.parameters()).device.type == "neuron"
    assert neuron.args.dataloader_pin_memory
    expected = losses(cpu)
    assert len(expected) == 4
    torch.testing.assert_close(losses(neuron), expected, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_trainer_with_torch_compile_matches_the_cpu_loss_log(any_mode):
    """``torch_compile=True``: Trainer picks backend "neuron" (is_torch_neuron_available)
    and the compiled steps give the loss log of CPU eager."""
    cpu, _ = train_causal_lm(use_cpu=True, steps=3)
    neuron, model = train_causal_lm(use_cpu=False, steps=3, torch_compile=True)
    assert neuron.args.torch_compile_backend == "neuron"
    import adaptive_eager

    compiled = adaptive_eager.stats()["compiled"]
    assert compiled["graph_calls"] >= 3  # the steps ran compiled graphs (Dynamo may reuse the other mode's)
    torch.testing.assert_close(losses(neuron), losses(cpu), rtol=1e-5, atol=0)


# -- Accelerate -----------------------------------------------------------------------


def accelerate_loop(cpu):
    from accelerate import Accelerator

    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)  # one process-wide state: each run starts from none
    PartialState._reset_state()
    accelerator = Accelerator(cpu=cpu)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    history = []
    for _ in range(2):
        for x, y in loader:
            assert x.device.type == accelerator.device.type
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            history.append(loss.item())
    return accelerator.device, history, [p.detach() for p in accelerator.unwrap_model(model).parameters()]


def test_accelerate_loop_matches_the_cpu(any_mode):
    pytest.importorskip("accelerate")
    device, history, params = accelerate_loop(cpu=False)
    cpu_device, expected, cpu_params = accelerate_loop(cpu=True)
    assert device.type == "neuron" and cpu_device.type == "cpu"
    torch.testing.assert_close(history, expected, rtol=1e-6, atol=0)
    for p, q in zip(params, cpu_params):
        assert_same(p, q, rtol=1e-5, atol=1e-7)


# -- PEFT -----------------------------------------------------------------------------


def lora_train(device, steps=3):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              lora_dropout=0.1, task_type="CAUSAL_LM"))
    model.to(device).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = token_rows(n=4).to(device)
    torch.manual_seed(5)  # the dropout masks: the device's generator draws what the CPU's does
    history = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(loss.item())
    return model.eval(), history


def test_peft_lora_trains_saves_and_reloads_as_on_the_cpu(any_mode, tmp_path):
    peft = pytest.importorskip("peft")
    model, history = lora_train("neuron")
    cpu_model, expected = lora_train("cpu")
    torch.testing.assert_close(history, expected, rtol=1e-5, atol=0)
    model.save_pretrained(tmp_path)  # from the device: safetensors reads the storages' data pointers
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path).to("neuron").eval()
    ids = token_rows(n=2, seed=9)
    with torch.no_grad():
        expected_logits = cpu_model(input_ids=ids).logits
        assert_same(reloaded(input_ids=ids.to("neuron")).logits, expected_logits, rtol=1e-4, atol=1e-5)
        merged = reloaded.merge_and_unload()
        assert_same(merged(input_ids=ids.to("neuron")).logits, expected_logits, rtol=1e-4, atol=1e-5)


# -- Diffusers ------------------------------------------------------------------------


def tiny_unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16),
                                 layers_per_block=1, norm_num_groups=4,
                                 down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                 up_block_types=("AttnUpBlock2D", "UpBlock2D"))


def ddpm_images(device):
    diffusers = pytest.importorskip("diffusers")
    pipeline = diffusers.DDPMPipeline(unet=tiny_unet(), scheduler=diffusers.DDPMScheduler(num_train_timesteps=20))
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator(device).manual_seed(0)  # the Diffusers idiom
    return pipeline(batch_size=2, generator=generator, num_inference_steps=5, output_type="np").images


def test_ddpm_pipeline_with_a_neuron_generator_matches_the_cpu(any_mode):
    """``torch.Generator("neuron")``: Diffusers' ``randn_tensor`` draws neuron latents on
    the host with the caller's generator; the device draws them from that generator's
    stream, as a CPU generator with the same seed would."""
    import numpy as np

    images = ddpm_images("neuron")
    expected = ddpm_images("cpu")
    assert images.shape == expected.shape == (2, 8, 8, 3)
    np.testing.assert_allclose(images, expected, rtol=0, atol=1e-5)


def test_unet_training_step_matches_the_cpu(any_mode):
    diffusers = pytest.importorskip("diffusers")

    def step(device):
        unet = tiny_unet().to(device)
        scheduler = diffusers.DDPMScheduler(num_train_timesteps=20)
        # SGD, not AdamW: the attention key biases' gradients are zero in exact arithmetic
        # (softmax ignores a constant per query), so both devices hold rounding noise
        # there (~1e-9), which Adam's normalization would blow up to +-lr either way.
        optimizer = torch.optim.SGD(unet.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(4)
        clean = torch.randn(2, 3, 8, 8, generator=g)
        noise = torch.randn(2, 3, 8, 8, generator=g)
        steps = torch.randint(0, 20, (2,), generator=g)
        noisy = scheduler.add_noise(clean.to(device), noise.to(device), steps.to(device))
        loss = torch.nn.functional.mse_loss(unet(noisy, steps.to(device)).sample, noise.to(device))
        loss.backward()
        grads = [p.grad.detach().clone() for p in unet.parameters()]
        optimizer.step()
        return loss.detach(), grads, [p.detach() for p in unet.parameters()]

    loss, grads, params = step("neuron")
    cpu_loss, cpu_grads, cpu_params = step("cpu")
    assert_same(loss, cpu_loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(grads, cpu_grads):
        assert_same(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(params, cpu_params):
        assert_same(a, b, rtol=1e-5, atol=1e-6)


# -- safetensors, save_pretrained, device_map -----------------------------------------


def test_safetensors_save_model_and_device_strings(any_mode, tmp_path):
    """``save_model``/``load_model`` from and to the device. ``load_file`` takes the device
    as an index (``device=0``, or ``"cuda:0"``-style names it knows): safetensors'
    own device parser refuses ``"neuron"``, so a neuron user passes the index."""
    safetensors = pytest.importorskip("safetensors.torch")
    model = tiny_llama().to("neuron")
    path = str(tmp_path / "model.safetensors")
    safetensors.save_model(model, path)  # tied and shared storages found from data pointers
    fresh = tiny_llama()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.to("neuron")
    missing, unexpected = safetensors.load_model(fresh, path)
    assert not missing and not unexpected
    for (name, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert a.device.type == "neuron" and torch.equal(a.cpu(), b.cpu()), name
    loaded = safetensors.load_file(path, device=0)
    assert {t.device.type for t in loaded.values()} == {"neuron"}
    with pytest.raises(Exception, match="device neuron is invalid"):
        safetensors.load_file(path, device="neuron")


def test_from_pretrained_device_map_neuron_round_trip(any_mode, tmp_path):
    """``save_pretrained`` from the device (Llama: untied; test_real_device.py covers
    GPT-2's tied weights), then ``from_pretrained(device_map="neuron")``: the same
    weights, on the device, and the CPU model's logits and greedy tokens."""
    model = tiny_llama().eval()
    ids = token_rows(n=1, length=6, seed=3)
    with torch.no_grad():
        expected_logits = model(ids).logits
    expected_tokens = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    model.to("neuron").save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="neuron").eval()
    assert {p.device for p in loaded.parameters()} == {torch.device("neuron", 0)}
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu()), name
    with torch.no_grad():
        assert_same(loaded(ids.to("neuron")).logits, expected_logits, rtol=1e-5, atol=1e-6)
    assert torch.equal(loaded.generate(ids.to("neuron"), max_new_tokens=5, do_sample=False, pad_token_id=0).cpu(),
                       expected_tokens)


def test_device_map_auto(tmp_path):
    """``device_map="auto"`` asks accelerate's ``get_max_memory``, which has no neuron
    branch (accelerate 1.15): it counts devices with ``torch.cuda``, finds none and puts
    everything on the CPU, on TorchNeuron as here. The public way to the device is
    ``max_memory`` with the device's index (accelerate warns that it does not see device 0,
    then places on it: integer devices are ``neuron:<i>`` where TorchNeuron is detected),
    or ``device_map="neuron"``. docs/HUGGING_FACE.md, "Library behaviours to know", says so."""
    pytest.importorskip("accelerate")
    model = tiny_llama().eval()
    model.save_pretrained(tmp_path)
    auto = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="auto")
    assert {p.device.type for p in auto.parameters()} == {"cpu"}  # accelerate's side, documented
    capped = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="auto",
                                                           max_memory={0: "1GiB", "cpu": "1GiB"}).eval()
    assert {p.device for p in capped.parameters()} == {torch.device("neuron", 0)}
    ids = token_rows(n=1, length=6, seed=3)
    with torch.no_grad():
        assert_same(capped(ids.to("neuron")).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


# -- TRL --------------------------------------------------------------------------------


def sft_losses(use_cpu, **extra):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import trl

    datasets.disable_progress_bars()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(5, 12, (16,), generator=g)]
    data = datasets.Dataset.from_dict({"input_ids": rows})
    config = trl.SFTConfig(output_dir="unused", use_cpu=use_cpu, max_steps=3, per_device_train_batch_size=4,
                           logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True, **extra)
    trainer = trl.SFTTrainer(model=tiny_llama(), args=config, train_dataset=data, processing_class=tiny_tokenizer())
    trainer.train()
    return config, losses(trainer)


def test_trl_sft_trainer_with_sft_config_defaults(any_mode):
    """``SFTConfig`` defaults on ``neuron``: bf16 autocast, gradient checkpointing and
    padding to a multiple of 128 (TRL's neuron default). The CPU reference runs with the
    same bf16 and padding settings. Losses agree to bf16 autocast's precision, not bit
    for bit: ``torch.autocast("neuron")`` applies CUDA's policy (device/ops/autocast.py),
    ``torch.autocast("cpu")`` the CPU's, which casts a different set of ops."""
    config, neuron = sft_losses(use_cpu=False)
    assert config.bf16 and config.gradient_checkpointing and config.pad_to_multiple_of == 128
    _, cpu = sft_losses(use_cpu=True, bf16=True, pad_to_multiple_of=128)
    assert len(cpu) == 3
    torch.testing.assert_close(neuron, cpu, rtol=2e-4, atol=0)
    _, neuron_fp32 = sft_losses(use_cpu=False, bf16=False)
    _, cpu_fp32 = sft_losses(use_cpu=True, bf16=False, pad_to_multiple_of=128)
    torch.testing.assert_close(neuron_fp32, cpu_fp32, rtol=1e-5, atol=0)
