"""The resumable prompt loader: seeded epochs, exact resume, epoch arithmetic."""

from posttrain.data.dataloader import ResumableLoader


def test_batches_are_full_reshuffle_per_epoch_and_resume_exactly():
    loader = ResumableLoader(list(range(10)), 4, seed=3)
    first = [loader.next_batch() for _ in range(3)]  # 12 items: spills into epoch 1
    assert all(len(b) == 4 for b in first)
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))  # epoch 0 is a permutation
    assert loader.epoch == 1 and loader.position == 2

    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(4)]
    resumed = ResumableLoader(list(range(10)), 4, seed=0)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(4)] == expected


def test_unshuffled_order_and_steps_for_epochs():
    loader = ResumableLoader(list("abcde"), 2, shuffle=False)
    assert [loader.next_batch() for _ in range(3)] == [["a", "b"], ["c", "d"], ["e", "a"]]
    assert loader.steps_for_epochs(1) == 3 and loader.steps_for_epochs(2) == 5
