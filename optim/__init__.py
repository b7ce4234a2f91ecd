"""Optimizers: update rules as plain tensor functions, one object that owns state and communication.

muon.py       Newton–Schulz orthogonalisation and the Muon (momentum, Nesterov, scale, apply) pieces
iterations.py the Newton–Schulz coefficients of each --muon_method (no torch: the config's checks read them)
optimizer.py  MuonAdam: both groups (Adam in torch's fused kernel), gradient averaging, Newton–Schulz split over ranks
schedule.py   learning-rate multiplier, Muon momentum warmup, attention-window growth: functions of the step
"""
