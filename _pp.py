import sys; sys.path.insert(0,'bench')
import argparse, _common as c, torch, time, copy
import lora_func as lf, peft
p=argparse.ArgumentParser(); c.add_model_args(p); a=p.parse_args(['--layers','32','--hidden','64','--vocab','128'])
torch.set_num_threads(1)
model=c.build_model(a); model.config._attn_implementation='eager'
base=lf.base_params(model)
T=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]
ad=lf.init_adapter(model,lf.AdapterSpec('lora',T,r=8))
pm=peft.get_peft_model(copy.deepcopy(model),peft.LoraConfig(r=8,target_modules=T))
ids=torch.tensor([[5]])
fns={'base':lambda: model(ids),'ours':lambda: lf.adapted_call(model,ad,ids,base=base),'peft':lambda: pm(ids),
'ov':lambda: lf.overlay(base,ad)}
with torch.no_grad():
  for k,f in fns.items():
    for _ in range(3): f()
  res={k:[] for k in fns}
  for r in range(7):
    for k,f in fns.items():
      t=time.perf_counter()
      for _ in range(10): f()
      res[k].append((time.perf_counter()-t)/10*1e3)
print({k:min(v) for k,v in res.items()})
