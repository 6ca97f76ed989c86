"""Fresh-process half of tests/test_kerashub.py: load a `.keras` file saved
mid-window, train the rest of the data on it, write the weights.

    python tests/scripts/kerashub_resume.py MODEL.keras DATA.npz START STOP OUT.npz
"""

import sys

import keras
import keras_hub  # noqa: F401
import numpy as np

import keras_accum  # noqa: F401 (registers the classes the file names)

path, data_path, start, stop, out = sys.argv[1:]
model = keras.saving.load_model(path)
data = dict(np.load(data_path))
weights = data.pop("sample_weight", None)
y = data.pop("y")
for begin in range(int(start), int(stop), 8):
    end = min(begin + 8, int(stop))
    model.train_on_batch(
        {key: value[begin:end] for key, value in data.items()},
        y[begin:end],
        sample_weight=None if weights is None else weights[begin:end],
    )
np.savez(out, *model.get_weights())
