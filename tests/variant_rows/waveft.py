import torch

from lora_func.variants._wavelet import _REC_LO
from tests.variant_table import Row


def _upsample(filt: torch.Tensor, coarse: int, crop: int) -> torch.Tensor:
    """``U (2·coarse − crop·2 + L − 2, coarse)``: ``U[2i + k − crop, i] = filt[k]``, the rows that
    one synthesis step of a length-``L`` filter reaches, ``crop`` cut off at each end."""
    length = filt.numel()
    full = torch.zeros(2 * coarse + length - 2, coarse, dtype=torch.float64)
    for i in range(coarse):
        full[2 * i : 2 * i + length, i] = filt
    return full[crop : full.shape[0] - crop]


def waveft_w_eff(p, b, W, bias, info):
    # variants.md (waveft): W_eff = W + scaling · IDWT2(C)[:d_out, :d_in], C the coefficients at
    # the fixed positions in a matrix padded by L − 2 (rounded up to even) and centred; the inverse
    # transform written as upsampling matrices per quadrant (an oracle without a convolution).
    options = dict(info.options)
    d_out, d_in = W.shape
    lo = torch.tensor(_REC_LO[options["wavelet_family"]], dtype=torch.float64)
    L = lo.numel()
    hi = torch.stack([(-1) ** i * lo[L - 1 - i] for i in range(L)])
    pad_out, pad_in = d_out + L - 2 + (d_out + L - 2) % 2, d_in + L - 2 + (d_in + L - 2) % 2
    C = torch.zeros(pad_out, pad_in, dtype=torch.float64)
    rows, cols = b["waveft_indices"].long()
    for k in range(rows.numel()):
        C[rows[k] + (pad_out - d_out) // 2, cols[k] + (pad_in - d_in) // 2] += p["waveft_spectrum"][k]
    h, w = pad_out // 2, pad_in // 2
    R = {"lo": _upsample(lo, h, L - 2), "hi": _upsample(hi, h, L - 2)}
    K = {"lo": _upsample(lo, w, L - 2), "hi": _upsample(hi, w, L - 2)}
    # quadrants [[cA, cH], [cV, cD]]: cH is high-pass along the rows, cV along the columns
    delta = (
        R["lo"] @ C[:h, :w] @ K["lo"].T
        + R["hi"] @ C[:h, w:] @ K["lo"].T
        + R["lo"] @ C[h:, :w] @ K["hi"].T
        + R["hi"] @ C[h:, w:] @ K["hi"].T
    )
    return W + options["scaling"] * delta[:d_out, :d_in], bias


TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

ROWS = (
    # r = 24 coefficients (peft's n_frequency); db2 (4 taps: the padded, offset and cropped path;
    # Haar has none); init_weights=True (peft's default): zeros, the identity. scaling 1 (peft's
    # default 25 puts ±3 entries into weights of ±0.1 at this perturbation).
    Row(
        variant="waveft",
        w_eff=waveft_w_eff,
        step0_nonzero=frozenset({"waveft_spectrum"}),
        spec_kwargs={"r": 24, "wavelet_family": "db2", "scaling": 1.0},
        perturb_scale=0.3,
        targets=TARGETS,
    ),
)
