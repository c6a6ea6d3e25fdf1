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


def test_lazy_datums_build_only_what_is_drawn_and_draw_like_a_list():
    """A lazy split gives the loader the same batches as the built list, building each drawn datum
    once; blend sources and routes come from the records without building anything."""
    from posttrain.data.dataloader import BlendedLoader, LazyDatums, make_loader, routes

    records = [{"prompt": f"p{i}", "task_name": "math", "env_name": "math",
                "source": "a" if i % 3 else "b", "source_weight": 2.0 if i % 3 else 1.0} for i in range(30)]
    built = []

    def build(record, index):
        built.append(index)
        return {**record, "idx": index}

    lazy = LazyDatums(records, build)
    assert len(lazy) == 30 and routes(lazy) == [("math", "math")] * 30 and built == []
    loader = make_loader(lazy, 4, seed=3)
    assert isinstance(loader, BlendedLoader) and built == []
    eager = make_loader([build(r, i) for i, r in enumerate(records)], 4, seed=3)
    built.clear()
    batches = [loader.next_batch() for _ in range(5)]
    assert batches == [eager.next_batch() for _ in range(5)]
    drawn = sorted({d["idx"] for batch in batches for d in batch})
    assert sorted(set(built)) == drawn and len(built) == len(drawn)  # built once each, nothing else
    assert lazy[-1]["idx"] == 29 and [d["idx"] for d in lazy[2:4]] == [2, 3]
