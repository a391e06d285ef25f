"""Hugging Face Llama checkpoints: config.json, the safetensors files, and the name-and-layout table.

Framework-free (Python, numpy and safetensors' header reader only), like `twinspec.llama`: the
torch loader (torchside.models.llama_hf) and the JAX one (jaxside.models.llama) read through it, so
the table exists once. Each reads box by box: torch with `safe_open(...).get_slice`, JAX ("numpy") from
views of the files' mappings, copied straight into its shards (`Checkpoint.read_box`).

The table (our names are the torch model's; the JAX twin's follow bridge.params' rule: a 2-D
`...weight` is the transposed `...kernel`, anything else keeps its name):

| ours | Hugging Face | rows |
|---|---|---|
| `embedding.weight` [Vp, D] | `model.embed_tokens.weight` [V, D] | same; rows V.. Vp are zeros |
| `lm_head.weight` [Vp, D] (untied only) | `lm_head.weight` [V, D] | same; rows V.. Vp are zeros |
| `layers.N.self_attention.layernorm_qkv.layer_norm_weight` | `model.layers.N.input_layernorm.weight` | same |
| `layers.N.self_attention.layernorm_qkv.weight` / `.bias` | `...self_attn.{q,k,v}_proj.weight` / `.bias` | grouped |
| `layers.N.self_attention.proj.weight` / `.bias` | `...self_attn.o_proj.weight` / `.bias` | same |
| `layers.N.layernorm_mlp.layer_norm_weight` | `model.layers.N.post_attention_layernorm.weight` | same |
| `layers.N.layernorm_mlp.fc1_weight` / `fc1_bias` | `...mlp.{gate,up}_proj.weight` / `.bias` | interleaved |
| `layers.N.layernorm_mlp.fc2_weight` / `fc2_bias` | `...mlp.down_proj.weight` / `.bias` | same |
| `norm.weight` | `model.norm.weight` | same |

"grouped": our fused QKV rows are grouped by key/value head (torchside.modules.multihead_attention):
for each of the G groups, its N/G query heads, then its key head, then its value head, H rows each.
"interleaved": our fc1 rows alternate gate and up in runs of `LlamaConfig.glu_interleave` (w) rows
(torchside.modules.layernorm_mlp): with w = 1 row 2i is gate row i, row 2i + 1 up row i.
Columns are never permuted: HF's o_proj reads heads in the order our proj does. HF's rotary
(`rotate_half` on the two halves of each head) is our layout too: tests/bridge/test_hf_llama.py
checks that against transformers' own logits rather than assuming it.

FP8 block-scaled checkpoints (config.json `quantization_config` = {"quant_method": "fp8",
"weight_block_size": [128, 128], "fmt": "e4m3"}: DeepSeek-V3's and transformers' FineGrainedFP8
format): every projection weight is F8_E4M3 `X.weight` [out, in] plus fp32 `X.weight_scale_inv`
[ceil(out/128), ceil(in/128)], value = weight * scale_inv of its 128 x 128 block; norms and the
embedding (and head) stay high precision. Such a checkpoint reads with `glu_interleave` = 128, and
only when head_dim, hidden_size and intermediate_size are multiples of 128: then each 128-row block
of our fused QKV and fc1 is one block-row of one HF tensor, so the bytes and scales keep their
blocks (`read_box(..., buffer="rowwise_data" / "rowwise_scale_inv")`); otherwise a block of ours
would mix two HF blocks with two scales, and requantizing would be lossy: ValueError.

`row_pieces` says where the rows [start, stop) of one of our tensors come from: a few contiguous
row ranges of HF tensors (or zeros), each written to every `step`-th row from `dest`. A loader reads
only those ranges (and only its columns), so each rank or device reads the bytes of its own shard.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from twinspec.llama import LlamaConfig, RopeScaling

ARCHITECTURE = "LlamaForCausalLM"
CONFIG_FILE, SINGLE_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports wrote; recomputed from the config
FLOAT_DTYPES = ("F32", "BF16", "F16")
FP8_DTYPE, SCALE_DTYPE, BLOCK = "F8_E4M3", "F32", 128  # an FP8 weight's bytes, its scales' dtype, the block
SCALE_SUFFIX = "_scale_inv"  # HF's name of a weight's scales: `X.weight` -> `X.weight_scale_inv`
FP8_QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK], "fmt": "e4m3"}


@dataclass(frozen=True)
class Source:
    """One of our tensors and the HF tensors it is made of; `kind`: "same", "vocab", "grouped" or "interleaved"."""

    ours: str
    kind: str
    hf_names: tuple[str, ...]


@dataclass(frozen=True)
class Piece:
    """HF rows [start, stop) of `hf_name` (None: zeros) go to our rows dest, dest + step, ... of the box."""

    hf_name: str | None
    start: int
    stop: int
    dest: int
    step: int = 1


def _layer_sources(config: LlamaConfig, i: int) -> list[Source]:
    ours, hf = f"layers.{i}.", f"model.layers.{i}."
    attn, mlp = hf + "self_attn.", hf + "mlp."
    qkv = tuple(f"{attn}{p}_proj" for p in "qkv")
    sources = [
        Source(ours + "self_attention.layernorm_qkv.layer_norm_weight", "same", (hf + "input_layernorm.weight",)),
        Source(ours + "self_attention.layernorm_qkv.weight", "grouped", tuple(n + ".weight" for n in qkv)),
        Source(ours + "self_attention.proj.weight", "same", (attn + "o_proj.weight",)),
        Source(ours + "layernorm_mlp.layer_norm_weight", "same", (hf + "post_attention_layernorm.weight",)),
        Source(ours + "layernorm_mlp.fc1_weight", "interleaved", (mlp + "gate_proj.weight", mlp + "up_proj.weight")),
        Source(ours + "layernorm_mlp.fc2_weight", "same", (mlp + "down_proj.weight",)),
    ]
    if config.bias:
        sources += [
            Source(ours + "self_attention.layernorm_qkv.bias", "grouped", tuple(n + ".bias" for n in qkv)),
            Source(ours + "self_attention.proj.bias", "same", (attn + "o_proj.bias",)),
            Source(ours + "layernorm_mlp.fc1_bias", "interleaved", (mlp + "gate_proj.bias", mlp + "up_proj.bias")),
            Source(ours + "layernorm_mlp.fc2_bias", "same", (mlp + "down_proj.bias",)),
        ]
    return sources


def sources(config: LlamaConfig) -> dict[str, Source]:
    """The table (module docstring) for one config, by our name."""
    table = [Source("embedding.weight", "vocab", ("model.embed_tokens.weight",))]
    if not config.tie_word_embeddings:
        table.append(Source("lm_head.weight", "vocab", ("lm_head.weight",)))
    for i in range(config.num_layers):
        table += _layer_sources(config, i)
    table.append(Source("norm.weight", "same", ("model.norm.weight",)))
    return {source.ours: source for source in table}


def ours_of(config: LlamaConfig) -> dict[str, str]:
    """The other direction: our name of every HF tensor name."""
    return {hf: source.ours for source in sources(config).values() for hf in source.hf_names}


def is_projection_weight(hf_name: str) -> bool:
    """q/k/v/o, gate/up/down `weight`s: the ones an FP8 checkpoint stores as F8_E4M3 bytes with scales."""
    return hf_name.endswith("_proj.weight")


def fp8_sources(config: LlamaConfig) -> dict[str, Source]:
    """The table's entries stored FP8 in an FP8 checkpoint (the projection weights), by our name."""
    return {ours: s for ours, s in sources(config).items() if is_projection_weight(s.hf_names[0])}


def hf_shapes(config: LlamaConfig, fp8: bool = False) -> dict[str, tuple[int, ...]]:
    """The shape every HF tensor must have for `config` (fp8: with each projection weight's `weight_scale_inv`)."""
    d, h, f, v = config.hidden_size, config.head_dim, config.ffn_hidden_size, config.vocab_size
    q, kv = config.num_heads * h, config.num_kv_heads * h
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": d, "gate_proj": f, "up_proj": f, "down_proj": d}
    cols = {"o_proj": q, "down_proj": f}
    shapes = {}
    for hf in ours_of(config):
        projection = hf.split(".")[-2]
        if hf.endswith("layernorm.weight") or hf == "model.norm.weight":
            shapes[hf] = (d,)
        elif projection in ("embed_tokens", "lm_head"):
            shapes[hf] = (v, d)
        elif hf.endswith(".bias"):
            shapes[hf] = (rows[projection],)
        else:
            shapes[hf] = (rows[projection], cols.get(projection, d))
            if fp8:
                shapes[hf + SCALE_SUFFIX] = tuple(-(-n // BLOCK) for n in shapes[hf])
    return shapes


def row_pieces(source: Source, config: LlamaConfig, start: int, stop: int) -> list[Piece]:
    """Where our rows [start, stop) of `source.ours` come from (module docstring), as few pieces as possible."""
    if source.kind == "same":
        return [Piece(source.hf_names[0], start, stop, 0)]
    if source.kind == "vocab":
        real = max(start, min(stop, config.vocab_size))
        pieces = [Piece(source.hf_names[0], start, real, 0)] if real > start else []
        return pieces + ([Piece(None, real, stop, real - start)] if stop > real else [])
    if source.kind == "interleaved" and config.glu_interleave == 1:
        pieces = []
        for parity, hf_name in enumerate(source.hf_names):  # gate on even rows, up on odd ones
            first = start + (parity - start) % 2
            if first < stop:
                pieces.append(Piece(hf_name, first // 2, (stop - 1 - parity) // 2 + 1, first - start, 2))
        return pieces
    if source.kind == "interleaved":  # runs of w rows: gate run j, then up run j
        w, pieces = config.glu_interleave, []
        for run in range(start // w, (stop - 1) // w + 1):
            lo, hi = max(start, run * w), min(stop, (run + 1) * w)
            hf_lo = (run // 2) * w + lo - run * w
            pieces.append(Piece(source.hf_names[run % 2], hf_lo, hf_lo + hi - lo, lo - start))
        return pieces
    if source.kind == "grouped":
        return _grouped_pieces(source, config, start, stop)
    raise AssertionError(f"unknown kind {source.kind!r}")


def _grouped_pieces(source: Source, config: LlamaConfig, start: int, stop: int) -> list[Piece]:
    h, per_group = config.head_dim, config.num_heads // config.num_kv_heads
    q_name, k_name, v_name = source.hf_names
    pieces: list[Piece] = []
    for block in range(start // h, (stop - 1) // h + 1):  # one head of H rows at a time
        group, slot = divmod(block, per_group + 2)
        if slot < per_group:
            name, head = q_name, group * per_group + slot
        else:
            name, head = (k_name if slot == per_group else v_name), group
        lo, hi = max(start, block * h), min(stop, (block + 1) * h)
        hf_lo = head * h + lo - block * h
        piece = Piece(name, hf_lo, hf_lo + hi - lo, lo - start)
        last = pieces[-1] if pieces else None
        continues = last and last.hf_name == name and last.stop == piece.start
        if continues and last.dest + last.stop - last.start == piece.dest:  # the next rows of the same tensor
            pieces[-1] = Piece(name, last.start, piece.stop, last.dest)
        else:
            pieces.append(piece)
    return pieces


def block_pieces(source: Source, config: LlamaConfig, start: int, stop: int) -> list[Piece]:
    """`row_pieces` of the scale rows [start, stop) of an FP8 weight: its 128-row blocks' pieces, of `X.weight_scale_inv`.

    Needs every piece of those rows to start and end on a block (`fp8_config`'s conditions).
    """
    pieces = []
    for piece in row_pieces(source, config, start * BLOCK, stop * BLOCK):
        if piece.step != 1 or (piece.start | piece.stop | piece.dest) % BLOCK:
            raise AssertionError(f"{piece} of {source.ours} cuts a {BLOCK}-row block")
        name = piece.hf_name + SCALE_SUFFIX
        pieces.append(Piece(name, piece.start // BLOCK, piece.stop // BLOCK, piece.dest // BLOCK))
    return pieces


def hf_order(config: LlamaConfig, fp8: bool = False) -> list[str]:
    """Every HF tensor name in the order transformers' LlamaForCausalLM lists its parameters (the writer's order).

    fp8: transformers' FP8Linear lists `weight`, `bias` (nn.Linear's, registered first), then `weight_scale_inv`.
    """
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        suffixes = (".weight", ".bias") if config.bias else (".weight",)
        suffixes += (".weight" + SCALE_SUFFIX,) if fp8 else ()
        names += [f"{layer}self_attn.{p}_proj{s}" for p in "qkvo" for s in suffixes]
        names += [f"{layer}mlp.{p}_proj{s}" for p in ("gate", "up", "down") for s in suffixes]
        names += [f"{layer}input_layernorm.weight", f"{layer}post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    return names + ([] if config.tie_word_embeddings else ["lm_head.weight"])


def our_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each of our tensors made from a checkpoint of `config` (unpadded vocabulary)."""
    shapes = hf_shapes(config)
    result = {}
    for ours, source in sources(config).items():
        parts = [shapes[name] for name in source.hf_names]
        result[ours] = (sum(p[0] for p in parts), *parts[0][1:])
    return result


# ---- reading a checkpoint directory


def _read_json(path: Path) -> dict:
    try:
        with open(path) as file:
            data = json.load(file)
    except FileNotFoundError as error:
        raise ValueError(f"{path}: not found; a Hugging Face model directory holds {path.name}") from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable JSON ({error}); re-download or re-save the checkpoint") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _rope(hf: dict, path: Path) -> tuple[float, RopeScaling | None]:
    """rope_theta and the llama3 scaling from `rope_parameters` (transformers >= 5) or `rope_scaling`."""
    parameters = dict(hf.get("rope_parameters") or {})
    parameters |= hf.get("rope_scaling") or {}
    theta = float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported; only 'default' and 'llama3' are")
    try:
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, RopeScaling(*(type_(parameters[k]) for k, type_ in zip(keys, (float, float, float, int))))
    except KeyError as error:
        raise ValueError(f"{path}: the llama3 rope scaling lacks {error}") from error


def read_config(directory: str | Path) -> tuple[LlamaConfig, dict | None]:
    """(our LlamaConfig, the quantization_config or None) of an HF Llama directory; ValueError naming the file.

    An FP8 checkpoint's config has glu_interleave = 128 (`fp8_config`).
    """
    path = Path(directory) / CONFIG_FILE
    return parse_config(_read_json(path), path)


def read_config_file(path: str | Path) -> tuple[Path, LlamaConfig, bool]:
    """(the file, our LlamaConfig, whether FP8) of an HF config.json, or of the one in directory `path` (the HF writer's input)."""
    path = Path(path)
    path = path / CONFIG_FILE if path.is_dir() else path
    config, quantization = parse_config(_read_json(path), path)
    return path, config, quantization is not None


def fp8_config(config: LlamaConfig, quantization: object, path: Path) -> LlamaConfig:
    """`config` with glu_interleave = 128 for an FP8 block-scaled checkpoint; ValueError naming the file otherwise.

    The module docstring says which checkpoints qualify and why the others are refused.
    """
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        raise ValueError(f"{path}: quantization_config={quantization}; only {FP8_QUANTIZATION} loads here")
    fmt, block = quantization.get("fmt", "e4m3"), quantization.get("weight_block_size")
    if fmt != "e4m3" or block != [BLOCK, BLOCK]:
        raise ValueError(
            f"{path}: quantization_config has fmt={fmt!r}, weight_block_size={block}; only fmt 'e4m3' with "
            f"[{BLOCK}, {BLOCK}] blocks (Float8BlockScaling's weights) loads"
        )
    sizes = {"head_dim": config.head_dim, "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size}
    for name, size in sizes.items():
        if size % BLOCK:
            raise ValueError(
                f"{path}: {name}={size} is not a multiple of {BLOCK}: a {BLOCK}-row block of our fused QKV or fc1 "
                f"would mix two HF blocks with two scales, and requantizing them is lossy, so it is not done; "
                "dequantize the checkpoint first (docs/hf.md)"
            )
    return dataclasses.replace(config, glu_interleave=BLOCK)


def parse_config(hf: dict, path: Path) -> tuple[LlamaConfig, dict | None]:
    """`read_config` on JSON already read from `path` (named in errors)."""
    architectures = hf.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise ValueError(f"{path}: architectures={architectures}, not [{ARCHITECTURE!r}]; only Llama loads here")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act={hf['hidden_act']!r}; Llama's MLP is SwiGLU ('silu')")
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise ValueError(
            f"{path}: attention_bias={hf.get('attention_bias')} but mlp_bias={hf.get('mlp_bias')}; our layers have "
            "one bias switch for every projection, so both must be equal"
        )
    theta, scaling = _rope(hf, path)
    try:
        heads = hf["num_attention_heads"]
        config = LlamaConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            ffn_hidden_size=hf["intermediate_size"],
            rope_theta=theta,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            head_dim=hf.get("head_dim"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            bias=bool(hf.get("attention_bias", False)),
        )
    except KeyError as error:
        raise ValueError(f"{path}: lacks {error}") from error
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error
    quantization = hf.get("quantization_config")
    return (config if quantization is None else fp8_config(config, quantization, path)), quantization


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", "F8_E4M3", ...
    begin: int  # where its bytes start in the file


def _data_begins(path: Path) -> dict[str, int]:
    """{tensor name: where its bytes start in the file} from a safetensors header (its 8-byte size, then JSON)."""
    with open(path, "rb") as file:
        header_size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(header_size))
    return {name: 8 + header_size + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


class Checkpoint:
    """An HF Llama directory, checked before any byte of a weight is read (config, files, names, shapes)."""

    def __init__(self, directory: str | Path, glu_interleave: int | None = None) -> None:
        """glu_interleave: present fc1 in runs of this many rows (None: 1, or 128 for an FP8 checkpoint)."""
        self.directory = Path(directory)
        self.config, self.quantization = read_config(self.directory)
        self.fp8 = self.quantization is not None
        if glu_interleave not in (None, self.config.glu_interleave):
            if self.fp8:
                raise ValueError(f"{self.directory}: an FP8 checkpoint's fc1 reads in runs of {BLOCK} rows only")
            self.config = dataclasses.replace(self.config, glu_interleave=glu_interleave)
        self.tensors = self._headers()
        self._check()
        self.sources = sources(self.config)
        self.fp8_sources = fp8_sources(self.config) if self.fp8 else {}
        self._mappings: dict[Path, object] = {}  # file -> its numpy memmap (`_view`)

    def _files(self) -> dict[str, Path]:
        """{tensor name: file} from the index, or None when the model is one file."""
        index_path = self.directory / INDEX_FILE
        if not index_path.exists():
            single = self.directory / SINGLE_FILE
            if not single.exists():
                raise ValueError(f"{self.directory}: neither {SINGLE_FILE} nor {INDEX_FILE}; not an HF model directory")
            return {}
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: no 'weight_map' object; re-save the checkpoint")
        files = {}
        for name, file in weight_map.items():
            path = self.directory / str(file)
            if not path.is_file():
                raise ValueError(f"{index_path}: tensor {name!r} is in {file!r}, which does not exist")
            files[name] = path
        return files

    def _headers(self) -> dict[str, TensorInfo]:
        from safetensors import SafetensorError, safe_open

        files = self._files()
        paths = sorted(set(files.values())) or [self.directory / SINGLE_FILE]
        tensors = {}
        for path in paths:
            try:
                with safe_open(str(path), framework="numpy") as file:
                    begins = _data_begins(path)  # (safe_open checked that each range has the tensor's bytes)
                    for name in file.keys():
                        piece = file.get_slice(name)
                        tensors[name] = TensorInfo(path, tuple(piece.get_shape()), piece.get_dtype(), begins[name])
            except (SafetensorError, OSError) as error:
                held = sorted(name for name, file in files.items() if file == path)
                names = f" (it holds tensor(s) {', '.join(held[:3])}{' ...' if len(held) > 3 else ''})" if held else ""
                raise ValueError(f"{path}: not a readable safetensors file ({error}){names}; re-download it") from error
        for name, path in files.items():
            if name in tensors and tensors[name].file != path:
                raise ValueError(f"{self.directory / INDEX_FILE}: tensor {name!r} is in {tensors[name].file.name}, "
                                 f"not {path.name} as the index says")  # fmt: skip
        return tensors

    def _check(self) -> None:
        expected = hf_shapes(self.config, self.fp8)
        for name, shape in expected.items():
            info = self.tensors.get(name)
            if info is None:
                why = f" (an FP8 checkpoint stores one beside each {FP8_DTYPE} weight)" if name.endswith(SCALE_SUFFIX) else ""
                raise ValueError(f"{self.directory}: tensor {name!r} is missing from the checkpoint{why}")
            if info.shape != shape:
                raise ValueError(
                    f"{info.file}: tensor {name!r} is {list(info.shape)}, but config.json gives {list(shape)}"
                    + (f" ([ceil(out/{BLOCK}), ceil(in/{BLOCK})] blocks)" if name.endswith(SCALE_SUFFIX) else "")
                )
            dtypes = FLOAT_DTYPES
            if self.fp8 and is_projection_weight(name):
                dtypes = (FP8_DTYPE,)
            elif name.endswith(SCALE_SUFFIX):
                dtypes = (SCALE_DTYPE,)
            if info.dtype not in dtypes:
                raise ValueError(f"{info.file}: tensor {name!r} is {info.dtype}; expected one of {dtypes}")
        tied_head = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        known = expected.keys() | tied_head
        extra = [n for n in self.tensors if n not in known and not n.endswith(IGNORED_SUFFIXES)]
        if extra:
            raise ValueError(f"{self.directory}: tensors {extra[:5]} are not part of a {ARCHITECTURE} of this config")

    def dtype(self) -> str:
        """The checkpoint's float dtype (of the embedding), as safetensors names it."""
        return self.tensors["model.embed_tokens.weight"].dtype

    def read_box(
        self, ours: str, rows: tuple[int, int], cols: tuple[int, int] | None, framework: str, put, buffer: str | None = None
    ) -> None:
        """Read our rows [rows) (and columns [cols) of a 2-D tensor) of `ours` in `framework` ("pt", "numpy").

        put(piece, values) receives each piece's values (None for a zeros piece): the caller writes them.
        "numpy" values are read-only views of the file's mapping (`_view`, bf16 as ml_dtypes.bfloat16):
        the bytes are read as put copies them into its buffer, with no copy in between.
        An FP8 weight (`self.fp8_sources`): `buffer` "rowwise_data" gives its bytes (numpy uint8),
        "rowwise_scale_inv" its scales (numpy fp32; rows and cols then count 128-blocks), None its
        values dequantized exactly (numpy fp32: each E4M3 value times its block's scale, one rounding).
        """
        import numpy as np
        from safetensors import SafetensorError, safe_open

        fp8 = ours in self.fp8_sources
        if buffer not in ((None, "rowwise_data", "rowwise_scale_inv") if fp8 else (None,)):
            raise AssertionError(f"{ours} has no buffer {buffer!r}")
        scales = buffer == "rowwise_scale_inv"
        pieces = (block_pieces if scales else row_pieces)(self.sources[ours], self.config, *rows)
        for piece in pieces:
            if piece.hf_name is None:
                put(piece, None)
                continue
            info, rows_read = self.tensors[piece.hf_name], (piece.start, piece.stop)
            try:
                if fp8 and not scales and buffer is None:
                    values = self._dequantized(piece, cols, self._view(info, rows_read, cols))
                elif framework == "numpy":
                    values = self._view(info, rows_read, cols)
                elif fp8 and not scales:  # safetensors' readers have no FP8: a copy of the mapping's bytes
                    values = np.array(self._view(info, rows_read, cols))
                else:
                    with safe_open(str(info.file), framework="numpy" if fp8 else framework) as file:
                        view = file.get_slice(piece.hf_name)
                        values = view[slice(*rows_read)] if cols is None else view[slice(*rows_read), slice(*cols)]
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{info.file}: reading tensor {piece.hf_name!r} failed ({error})") from error
            put(piece, values)

    def _view(self, info: TensorInfo, rows: tuple[int, int], cols: tuple[int, int] | None):
        """Rows [rows) and columns [cols) of a tensor as numpy: a view of its file, mapped once, nothing read yet."""
        import numpy as np

        if info.file not in self._mappings:
            self._mappings[info.file] = np.memmap(info.file, np.uint8, "r")
        dtype = _numpy_dtype(info.dtype)
        size = math.prod(info.shape) * dtype.itemsize
        tensor = self._mappings[info.file][info.begin : info.begin + size].view(dtype).reshape(info.shape)
        return tensor[slice(*rows)] if cols is None else tensor[slice(*rows), slice(*cols)]

    def _dequantized(self, piece: Piece, cols: tuple[int, int], data):
        """Bytes `data` of HF rows [piece) and columns [cols) as fp32 values: E4M3 times the block's scale_inv."""
        import ml_dtypes
        import numpy as np

        first_row, first_col = piece.start // BLOCK, cols[0] // BLOCK
        block_rows, block_cols = (first_row, -(-piece.stop // BLOCK)), (first_col, -(-cols[1] // BLOCK))
        blocks = self._view(self.tensors[piece.hf_name + SCALE_SUFFIX], block_rows, block_cols)
        scale = np.repeat(np.repeat(blocks, BLOCK, axis=0), BLOCK, axis=1)
        r0, c0 = piece.start - first_row * BLOCK, cols[0] - first_col * BLOCK
        scale = scale[r0 : r0 + data.shape[0], c0 : c0 + data.shape[1]]
        return data.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale.astype(np.float32)


def _numpy_dtype(safetensors_dtype: str):
    """The numpy dtype of a safetensors dtype name that `Checkpoint._check` lets through (F8_E4M3: its bytes, uint8)."""
    import ml_dtypes
    import numpy as np

    dtypes = {"F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16, FP8_DTYPE: np.uint8}
    return np.dtype(dtypes[safetensors_dtype])


__all__ = [
    "ARCHITECTURE",
    "BLOCK",
    "FP8_QUANTIZATION",
    "SCALE_SUFFIX",
    "Checkpoint",
    "Piece",
    "Source",
    "TensorInfo",
    "block_pieces",
    "fp8_config",
    "fp8_sources",
    "hf_order",
    "hf_shapes",
    "is_projection_weight",
    "our_shapes",
    "ours_of",
    "parse_config",
    "read_config",
    "read_config_file",
    "row_pieces",
    "sources",
]
