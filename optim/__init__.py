"""Optimizers: update rules as plain tensor functions, one object that owns state and communication.

muon.py       Muon's pieces: momentum, Newton–Schulz, NorMuon, apply
iterations.py the Newton–Schulz coefficients of each --muon_method
optimizer.py  MuonAdam: both groups, gradient averaging, Newton–Schulz split over ranks
schedule.py   learning rate, Muon momentum and attention window as functions of the step
"""
