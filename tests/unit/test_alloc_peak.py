"""harness.alloc_peak against sizes known by construction (torch's own element sizes)."""

import torch

from harness.alloc_peak import AllocationTrace

MIB = 1 << 20


def test_peak_is_the_largest_sum_of_live_allocations_in_the_window():
    with AllocationTrace() as trace:
        a = torch.empty(MIB // 4)  # 1 MiB, before the window
        with trace.window("w"):
            b = torch.empty(MIB // 2)  # 2 MiB: 3 live
            del b
            c = torch.empty(MIB // 8)  # 0.5 MiB: 1.5 live
        del a, c
    assert trace.peak("w") == 3 * MIB
    assert trace.at_start("w") == MIB
    assert trace.peak() == 3 * MIB


def test_a_free_of_memory_allocated_before_the_trace_does_not_lower_the_peak():
    old = torch.empty(MIB)  # 4 MiB, a previous run's tensor freed while this one is measured
    with AllocationTrace() as trace:
        with trace.window("w"):
            del old
            x = torch.empty(MIB // 4)
        del x
    assert trace.peak("w") == MIB


def test_a_block_freed_on_another_thread_counts_until_its_allocating_operation_ended():
    """Note [frees on other threads]: the profiler records no free made on an unprofiled thread; with
    `released=True` such a block is taken as freed when its allocating operation ended."""
    import threading

    from torch.profiler import record_function

    box = {}
    with AllocationTrace(released=True) as trace:
        with trace.window("w"):
            with record_function("hand_off"):
                box["a"] = torch.empty(MIB // 4)  # 1 MiB, freed unrecorded by the thread below
            worker = threading.Thread(target=box.clear)
            worker.start()
            worker.join()
            b = torch.empty(MIB // 2)  # 2 MiB: counting `a` for ever would make the peak 3 MiB
            del b
    assert trace.peak("w") == 2 * MIB
