"""How the scaler splits a deployment's replicas across the revisions it serves."""

from services.scaler.service import split_by_revision


def test_one_revision_takes_all():
    assert split_by_revision(3, {1: 100}) == {1: 3}


def test_canary_gets_its_share_and_at_least_one():
    assert split_by_revision(10, {1: 80, 2: 20}) == {1: 8, 2: 2}
    assert split_by_revision(2, {1: 90, 2: 10}) == {1: 1, 2: 1}
    assert split_by_revision(1, {1: 80, 2: 20}) == {1: 1, 2: 1}  # a canary cannot serve from nothing


def test_zero_desired_stops_every_revision():
    assert split_by_revision(0, {1: 80, 2: 20}) == {1: 0, 2: 0}
