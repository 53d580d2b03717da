"""What a run shows a person, below the Trainer and the tasks so that both (and the command
line) can use it: loss curves and figures (plot.py), text samples and their layout in the
console and in RUN/samples.txt (samples.py)."""
