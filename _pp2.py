import sys; sys.path.insert(0,'bench')
import argparse, _common as c, torch, time, cProfile, pstats
import lora_func as lf
p=argparse.ArgumentParser(); c.add_model_args(p); a=p.parse_args(['--layers','32','--hidden','64','--vocab','128'])
model=c.build_model(a)
base=lf.base_params(model)
T=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]
ad=lf.init_adapter(model,lf.AdapterSpec('lora',T,r=8))
cProfile.run('for _ in range(50): lf.overlay(base,ad)','/tmp/prof2.out')
pstats.Stats('/tmp/prof2.out').sort_stats('tottime').print_stats(25)
