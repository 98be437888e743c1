from __future__ import annotations

import pytest

from workers.client_ids import LOCAL_MASK, ClientIdAllocator, frontend_of, lane_of, make_client_id


def test_frontend_zero_ids_are_bare_sequence_numbers():
    ids = ClientIdAllocator(0)
    assert [ids.next_id() for _ in range(3)] == [0, 1, 2]


def test_frontend_id_is_in_the_top_16_bits():
    ids = ClientIdAllocator(3)
    assert [ids.next_id() for _ in range(2)] == [3 << 48, (3 << 48) + 1]
    assert frontend_of(make_client_id(65535, LOCAL_MASK)) == 65535
    assert make_client_id(65535, LOCAL_MASK) == 2**64 - 1


def test_each_id_routes_to_its_frontends_lane():
    assert lane_of(make_client_id(0, 7), 4) == 0
    assert lane_of(make_client_id(1, 7), 4) == 1
    assert lane_of(make_client_id(3, 0), 4) == 3


def test_unroutable_id_goes_to_lane_zero():
    assert lane_of(make_client_id(4, 1), 4) == 0  # frontend 4 of a 4-frontend worker does not exist
    assert lane_of(make_client_id(65535, 1), 1) == 0
    assert lane_of(2**64 + 5, 4) == 0  # wider than a uint64: frontend id 65536


@pytest.mark.parametrize("frontend_id, local_id", [(-1, 0), (65536, 0), (0, -1), (0, 1 << 48)])
def test_out_of_range_parts_are_refused(frontend_id, local_id):
    with pytest.raises(ValueError):
        make_client_id(frontend_id, local_id)
