import lora_func as lf, torch, json
from safetensors import safe_open
from tests.models import tiny_model
m=tiny_model('llama')
a=lf.init_adapter(m, lf.AdapterSpec("alora", targets=["q_proj"], r=4))
f=lf.save(a,"/tmp/f.safetensors"); s=lf.save(a,"/tmp/s.safetensors", trainable_only=True)
for p in (f,s):
    with safe_open(str(p),"pt") as h: md=h.metadata()
    print({k: len(v) for k,v in md.items()})
    print(open(p,'rb').read(8))
