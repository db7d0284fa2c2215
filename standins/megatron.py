"""twinkle-kit's Megatron path on the CPU, for the tests and the benchmarks.

- ``megatron_cpu()``: a gloo world of size 1 with Megatron's model-parallel
  state, and ``cpu_schedules()``: its scheduler's one CUDA allocation sent to the
  CPU; all undone on exit.
- ``fail_unpacking()``: TWINKLE_FAIL_FAST=0 and twinkle's per-micro-batch unpacking
  failing on chosen calls (twinkle's forward step catches the error).
- ``ToyLM``: the smallest model Megatron's scheduler accepts, recording a weak
  reference to the storage of every logits tensor it produces (``LogitsTracker``),
  so a test can tell how many bytes of logits are still alive at any point.
- ``twinkle_megatron_model()``: twinkle's real ``MegatronModel`` around a
  ``ToyLM`` or a real megatron-core ``GPTModel`` (``gpt_model()``, run on the CPU
  under ``megatron_gpt_cpu()``), built without downloading a checkpoint.
- ``twinkle_transformers_model()``: twinkle's real ``TransformersModel`` around a
  tiny transformers causal LM built from a config.
- ``lm_samples()``: samples as twinkle's processor takes them; ``run_step()`` one
  ``forward_only`` or ``forward_backward``, ``step_status()`` / ``step_labels()`` what
  twinkle kept of it.
"""
import contextlib
import logging
import socket
import types
import weakref

import torch
from torch import nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NoStream:
    """A CUDA stream on the CPU: the work is already in order."""

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class _CpuTorch:
    """``torch`` as a megatron module sees it on the CPU: ``zeros`` / ``tensor(device="cuda")`` ``empty`` allocate
    on the CPU (the schedules' one CUDA allocation, the optimizer's scalars, mcore_bridge's export buffers), ``torch.cuda.current_device()`` answers "cpu" (p2p receive
    buffers and shape tensors, RoPE's frequencies, the SP and DDP buffers),
    ``torch.cuda.synchronize()`` does nothing and its streams are :class:`_NoStream`."""

    class _Cuda:
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            return getattr(self._real, name)

        @staticmethod
        def current_device():
            return "cpu"

        @staticmethod
        def synchronize(device=None):
            pass

        # CUDA streams (Megatron-Bridge builds Megatron's DDP on a side stream): one stream, nothing to order
        Stream = staticmethod(lambda *args, **kwargs: _NoStream())
        current_stream = staticmethod(lambda *args, **kwargs: _NoStream())
        stream = staticmethod(lambda *args, **kwargs: contextlib.nullcontext())

    def __init__(self, real):
        self._real = real
        self.cuda = self._Cuda(real.cuda)

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def _cpu(device):
        return "cpu" if device is not None and torch.device(device).type == "cuda" else device

    def zeros(self, *args, device=None, **kwargs):
        return self._real.zeros(*args, device=self._cpu(device), **kwargs)

    def tensor(self, *args, device=None, **kwargs):  # (megatron's optimizer: its scalars)
        return self._real.tensor(*args, device=self._cpu(device), **kwargs)

    def empty(self, *args, device=None, **kwargs):
        return self._real.empty(*args, device=self._cpu(device), **kwargs)


@contextlib.contextmanager
def torch_on_cpu(*modules):
    """Each of ``modules`` (megatron modules that ask ``torch`` for a CUDA device) sees
    :class:`_CpuTorch` as its ``torch``; undone on exit."""
    saved = [(module, module.torch) for module in modules]
    for module, real in saved:
        module.torch = _CpuTorch(real)
    try:
        yield
    finally:
        for module, real in saved:
            module.torch = real


@contextlib.contextmanager
def cpu_schedules():
    """megatron-core's schedules module with its one CUDA allocation (``torch.zeros(device="cuda")``)
    on the CPU; undone on exit."""
    from megatron.core.pipeline_parallel import schedules
    with torch_on_cpu(schedules):
        yield


@contextlib.contextmanager
def cpu_p2p():
    """megatron-core's pipeline p2p communication on the CPU (gloo carries the traffic); undone on exit."""
    from megatron.core.pipeline_parallel import p2p_communication
    with torch_on_cpu(p2p_communication):
        yield


@contextlib.contextmanager
def megatron_cpu():
    import torch.distributed as dist
    from megatron.core import parallel_state

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        with cpu_schedules():
            yield
    finally:
        if own_state:
            parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


@contextlib.contextmanager
def gpt_step_on_cpu():
    """What twinkle's Megatron step on a megatron-core GPTModel needs in one CPU process: a world of its own
    (``megatron_cpu``), the GPTModel's CPU buffers, twinkle's Platform on the CPU."""
    with megatron_cpu(), megatron_gpt_cpu(), cpu_platform("cpu"):
        yield


@contextlib.contextmanager
def gpt_step_in_world():
    """The same for a rank of a gloo world the caller started (tests/helpers.py's ``Cases``): megatron's
    schedules and pipeline p2p on the CPU, the GPTModel's CPU buffers, twinkle's Platform on the CPU."""
    with cpu_schedules(), cpu_p2p(), megatron_gpt_cpu(), cpu_platform("cpu"):
        yield


def fail_unpacking(monkeypatch, target, failing):
    """TWINKLE_FAIL_FAST=0, and ``target.unpack_packed_sequences`` (a processor's, or
    ``InputProcessor``'s for every processor) raising on the calls numbered in ``failing``
    (from 0; twinkle's forward step calls it once per micro-batch, then once per input):
    twinkle's forward step catches the error and reports no log-probs for that micro-batch.
    Undone by ``monkeypatch``; returns the real ``unpack_packed_sequences``."""
    monkeypatch.setenv("TWINKLE_FAIL_FAST", "0")
    # pytest's log capture keeps twinkle's warning record, whose args hold the exception,
    # its traceback and so the failed micro-batch's frame and logits: make no record.
    monkeypatch.setattr(logging.getLogger("twinkle"), "disabled", True)
    real_unpack = target.unpack_packed_sequences
    calls = []

    def unpack(*args, **kwargs):
        calls.append(1)
        if len(calls) - 1 in failing:
            raise ValueError("simulated data-processing error")
        return real_unpack(*args, **kwargs)

    monkeypatch.setattr(target, "unpack_packed_sequences", unpack)
    return real_unpack


class LogitsTracker:
    """Weak references to the storages of logits; ``live_bytes()`` sums those still alive
    (held by Python or by autograd alike), ``peak`` the most seen at a ``sample()``."""

    def __init__(self):
        self.refs = []
        self.peak = 0

    def track(self, logits: torch.Tensor) -> None:
        storage = logits.untyped_storage()
        self.refs.append((weakref.ref(storage), storage.nbytes()))

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.refs if ref() is not None)

    def sample(self) -> int:
        live = self.live_bytes()
        self.peak = max(self.peak, live)
        return live


class ToyLM(nn.Module):
    """Embedding + vocab projection; what Megatron's no-pipelining scheduler needs."""

    def __init__(self, vocab: int, hidden: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0):
        super().__init__()
        from megatron.core.enums import ModelType
        from megatron.core.transformer import TransformerConfig
        # calculate_per_token_loss as twinkle configures Megatron models
        self.config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1,
                                        calculate_per_token_loss=True)
        self.model_type = ModelType.encoder_or_decoder
        self.vp_stage = None
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype)
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, hidden, generator=gen))
            self.head.weight.copy_(torch.randn(vocab, hidden, generator=gen) / hidden**0.5)
        self.tracker = LogitsTracker()

    def set_input_tensor(self, input_tensor) -> None:
        pass

    def forward(self, input_ids, **_):
        self.tracker.sample()  # what earlier micro-batches still hold when this one starts
        logits = self.head(self.embed(input_ids))
        self.tracker.track(logits)
        self.tracker.sample()
        return logits


@contextlib.contextmanager
def sample_after_scheduler(tracker: LogitsTracker, live_after: list):
    """Record the live logits bytes the moment Megatron's scheduler returns its reports,
    i.e. before the caller has collected them."""
    import megatron.core.pipeline_parallel as pp
    real_get = pp.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        schedule = real_get(*args, **kwargs)

        def run(**kw):
            reports = schedule(**kw)
            live_after.append(tracker.sample())
            return reports

        return run

    pp.get_forward_backward_func = get_forward_backward_func
    try:
        yield
    finally:
        pp.get_forward_backward_func = real_get


@contextlib.contextmanager
def cpu_platform(device_prefix: str = "cpu"):
    """twinkle's ``Platform`` reporting ``device_prefix`` while placing tensors on the CPU."""
    from twinkle.utils.platforms.base import Platform
    saved = {name: Platform.__dict__[name] for name in ("get_local_device", "device_prefix")}
    Platform.get_local_device = staticmethod(lambda idx=None, *, platform=None: "cpu")
    Platform.device_prefix = staticmethod(lambda platform=None: device_prefix)
    try:
        yield
    finally:
        for name, raw in saved.items():
            setattr(Platform, name, raw)


def twinkle_megatron_model(toy: nn.Module, loss=None, variable_seq_lengths: bool = False, tp_size: int = 1,
                           sequence_parallel: bool = False, pp_size: int = 1):
    """twinkle's ``MegatronModel`` with the state its ``forward_backward`` reads, around ``toy``
    (a ``ToyLM``, or a megatron-core model chunk).

    ``MegatronModel.__init__`` downloads a checkpoint and builds the model through
    mcore_bridge; everything ``forward_backward`` uses is set here instead.
    """
    from twinkle import DeviceMesh
    from twinkle.loss import CrossEntropyLoss
    from twinkle.model.megatron.megatron import MegatronModel
    from twinkle.model.megatron.strategy.megatron import MegatronStrategy
    from twinkle.processor import InputProcessor

    mesh = DeviceMesh.from_sizes(world_size=tp_size * pp_size, dp_size=1, tp_size=tp_size, pp_size=pp_size,
                                 sequence_parallel=sequence_parallel)
    strategy = MegatronStrategy.__new__(MegatronStrategy)
    strategy.device_mesh = mesh
    processor = InputProcessor(framework="megatron")
    processor.device_mesh = mesh  # twinkle drops a mesh passed without twinkle.initialize()

    model = MegatronModel.__new__(MegatronModel)
    nn.Module.__init__(model)
    model.device_mesh = mesh
    model.strategy = strategy
    model.model = [toy]
    model.variable_seq_lengths = variable_seq_lengths
    model._model_wrapped = True
    model._finish_config = True
    model.active_group = ""
    model.optimizer_group = {
        "": types.SimpleNamespace(
            loss_instance=loss if loss is not None else CrossEntropyLoss(reduction="sum"),
            template=None,
            processor=processor,
            cur_step=0,
            train_status=types.SimpleNamespace(),
            eval_status=types.SimpleNamespace(),
            accumulate_metrics=lambda is_training: None,
        )
    }
    return model


@contextlib.contextmanager
def megatron_gpt_cpu():
    """What megatron-core 0.16.1's GPTModel needs to run on the CPU: its attention's scratch
    buffer allocated on the CPU, and no CUDA RNG state forks (no dropout is used). Undone on exit."""
    from megatron.core import utils
    from megatron.core.tensor_parallel import random

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)

    saved = [(utils.GlobalMemoryBuffer, "get_tensor"), (random.CudaRNGStatesTracker, "fork")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in saved]
    utils.GlobalMemoryBuffer.get_tensor = get_tensor
    random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    try:
        yield
    finally:
        for owner, name, raw in saved:
            setattr(owner, name, raw)


def gpt_model(vocab: int, hidden: int = 32, heads: int = 4, layers: int = 1, max_seq: int = 128, tied: bool = False,
              dtype: torch.dtype = torch.float32, sequence_parallel: bool = False, seed: int = 0) -> nn.Module:
    """A small megatron-core ``GPTModel`` (local layer spec, learned positions: RoPE needs CUDA)
    for the current model-parallel state (under pipeline parallelism: this stage's layers, with the
    embedding on the first stage and the output layer on the last); ``dtype=torch.bfloat16`` wraps it in ``Float16Module``,
    as Megatron trains in bf16. The same seed gives the same full weights whatever the TP size
    (``use_cpu_initialization`` initialises the full matrix, then takes this rank's part)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron.core import parallel_state
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               calculate_per_token_loss=True, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
                               sequence_parallel=sequence_parallel, bf16=dtype == torch.bfloat16)
    torch.manual_seed(seed)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=max_seq,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=tied,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    if model.pre_process:  # twinkle pads position_ids with -1; a learned position table needs an index there.
        model.embedding.position_embeddings.register_forward_pre_hook(lambda _, args: (args[0].clamp(min=0), ))
    if dtype == torch.bfloat16:
        model = Float16Module(config, model)
    return model


def twinkle_transformers_model(vocab: int, hidden: int = 32, tied: bool = False, dtype: torch.dtype = torch.float32,
                               loss=None, seed: int = 0, config=None, mixed_precision: str = "no"):
    """twinkle's real ``TransformersModel`` around a one-layer Qwen2 causal LM built from a config
    (no download; twinkle's default template, which needs a tokenizer, left out). ``config``: a
    transformers config to use instead, or a dict of Qwen2Config settings to add. ``mixed_precision``:
    twinkle's setting ("bf16": accelerate runs the forward under CPU autocast)."""
    import transformers
    import twinkle.model.transformers.transformers as twinkle_transformers
    if config is None or isinstance(config, dict):
        config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=128, tie_word_embeddings=tied, **(config or {}))
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)  # process-wide; twinkle's strategy creates an Accelerator per model
    template = twinkle_transformers.Template
    twinkle_transformers.Template = lambda *args, **kwargs: None
    torch.manual_seed(seed)
    try:
        model = twinkle_transformers.TransformersModel(model_cls=transformers.AutoModelForCausalLM, config=config,
                                                       mixed_precision=mixed_precision)
    finally:
        twinkle_transformers.Template = template
    model.model.to(dtype)
    if loss is not None:
        model.set_loss(loss)
    return model


def lm_samples(lengths, vocab: int, seed: int = 0, prompt: int = 0):
    """Encoded samples (input_ids, labels, attention_mask, position_ids) as twinkle's templates produce
    them; the labels of the first ``prompt`` tokens (the prompt, in RL) are -100."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n, ), generator=gen)
        labels = torch.roll(ids, -1)
        labels[-1] = -100
        labels[:prompt] = -100
        samples.append({
            "input_ids": ids,
            "labels": labels,
            "attention_mask": torch.ones(n, dtype=torch.long),
            "position_ids": torch.arange(n),
        })
    return samples


def run_step(model, forward_only: bool, advantages=None, **kwargs):
    """One twinkle step: ``model.forward_only(**kwargs)``, or ``model.forward_backward(advantages=advantages,
    **kwargs)``; returns its output."""
    if forward_only:
        return model.forward_only(**kwargs)
    return model.forward_backward(advantages=advantages, **kwargs)


def step_status(model, forward_only: bool):
    """What twinkle kept of the model's last step (its ``inputs`` and ``outputs``): the eval status after
    ``forward_only``, the train status after ``forward_backward``."""
    group = model.optimizer_group[""]
    return group.eval_status if forward_only else group.train_status


def step_labels(model, forward_only: bool) -> torch.Tensor:
    """The labels of the last step's micro-batches (one input each on the Megatron path), concatenated."""
    return torch.cat([inp["labels"] for inp in step_status(model, forward_only).inputs])
