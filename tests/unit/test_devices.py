"""``hsgd.pick_device``'s answers that need no MPI job (the collective ones: tests/e2e/test_examples.py)."""

import pytest
import torch

import hsgd


def test_pick_device_cpu_needs_no_mpi_and_a_bad_choice_is_an_input_error():
    assert hsgd.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(hsgd.InputValueError, match="unknown device 'tpu'; use one of cpu, cuda, auto"):
        hsgd.pick_device("tpu")
