"""Text classification: a pooled linear head on the GPT trunk, trained by the one Trainer.

    distlm prepare --task classify data.csv --out data/news --label-field topic --max-len 128
    distlm train --config classify                       # the vendored 4-topic 20 Newsgroups set
    torchrun --nproc_per_node 2 -m distlm train --config classify parallel.dp_replicate=2
    distlm eval --checkpoint runs/NAME
    distlm predict --checkpoint runs/NAME --input texts.txt --out predictions.csv

data.py (rows in, padded token arrays + label map out), distlm/model/classifier.py (Classifier, pooling),
loader.py (global batches, trimmed to their longest row), metrics.py (accuracy,
macro-F1, confusion matrix), task.py (the Trainer hook), predict.py (a trained classifier's
probabilities); the eval and predict verbs are in distlm/cli/classify.py.
"""
