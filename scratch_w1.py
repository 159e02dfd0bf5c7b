import copy, torch, peft, warnings
import lora_func as lf
from tests.models import tiny_model, tokens
from tests.test_variants_structured_c import _rmsnorm_in_input_dtype, perturb, check_against_peft, check_reloads_in_peft
import tempfile, pathlib
m = _rmsnorm_in_input_dtype(tiny_model("llama", seed=1, dtype=torch.float64))
for fam, idwt in [("db1", True), ("db3", True), ("sym2", True), ("coif1", True), ("db1", False)]:
    d = pathlib.Path(tempfile.mkdtemp())
    cfg = peft.WaveFTConfig(n_frequency=40, scaling=7.0, wavelet_family=fam, use_idwt=idwt, random_loc_seed=5, target_modules=["q_proj","v_proj","down_proj"])
    pm = peft.get_peft_model(copy.deepcopy(m), cfg).eval()
    perturb(pm, "waveft_spectrum")
    pm.save_pretrained(d / "peft")
    a, ids, want = check_against_peft(m, pm, d / "peft", "waveft_spectrum", "waveft_spectrum")
    check_reloads_in_peft(m, a, ids, want, d)
    print(fam, idwt, "ok")
