"""What a sweep (`python train.py -m ...`) needs beyond its jobs: each job run apart, its summary, its workers'
devices and lifetime, Optuna's pruning, its MLflow parent run."""
