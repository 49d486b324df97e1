"""MongoDB's documented semantics for the few operators the MongoDB store's documents
use: enough to run its update pipelines and filters on a document in memory.

Not a server, and not used as one: the store never talks to this. Tests apply the
documents the store *builds* to lease documents, in the order a sequence of steps
would, and check what each step leaves (who holds the key, its fence, its expiry).
What it encodes, from MongoDB's manual: aggregation expressions see the stage's input
document (every ``$set`` field of one stage is computed from the same input); a
missing field is distinct from null, and sorts below everything in comparisons (BSON
order: missing < null < numbers < strings < dates); ``$cond``, ``$not``, ``$and``,
``$or`` treat null, missing, false and 0 as false; ``$$NOW`` is one instant for the
whole update; a date plus a number adds milliseconds; ``$toLong`` of a date is its
milliseconds since the epoch. An operator it does not know raises: a document the
store starts to send with another operator fails these tests until it is taught.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Any

_EPOCH = datetime.datetime(1970, 1, 1)


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def _order(value: Any) -> tuple[int, Any]:
    if value is MISSING:
        return (-1, 0)
    if value is None:
        return (0, 0)
    if isinstance(value, bool):
        return (4, value)
    if isinstance(value, int | float):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    if isinstance(value, datetime.datetime):
        return (5, value)
    raise TypeError(f"no BSON order known here for {value!r}")


def _true(value: Any) -> bool:
    return not (value is MISSING or value is None or value is False or value == 0)


def _type(value: Any) -> str:
    if value is MISSING:
        return "missing"
    if value is None:
        return "null"
    return {bool: "bool", int: "long", float: "double", str: "string"}.get(
        type(value), "date" if isinstance(value, datetime.datetime) else "object"
    )


def _add(values: list[Any]) -> Any:
    dates = [v for v in values if isinstance(v, datetime.datetime)]
    numbers = sum(v for v in values if not isinstance(v, datetime.datetime))
    if not dates:
        return numbers
    (date,) = dates
    return date + datetime.timedelta(milliseconds=numbers)


def evaluate(expression: Any, doc: Mapping[str, Any], now: datetime.datetime) -> Any:
    """An aggregation expression's value for ``doc``."""
    if isinstance(expression, str):
        if expression == "$$NOW":
            return now
        if expression.startswith("$$"):
            raise NotImplementedError(expression)
        if expression.startswith("$"):
            return doc.get(expression[1:], MISSING)
        return expression
    if isinstance(expression, list):
        return [evaluate(item, doc, now) for item in expression]
    if not isinstance(expression, dict):
        return expression
    if len(expression) != 1 or not next(iter(expression)).startswith("$"):
        return {name: evaluate(value, doc, now) for name, value in expression.items()}
    ((operator, argument),) = expression.items()
    if operator == "$literal":
        return argument
    args = argument if isinstance(argument, list) else [argument]
    if operator == "$cond":
        condition, then, otherwise = args
        return evaluate(then if _true(evaluate(condition, doc, now)) else otherwise, doc, now)
    values = [evaluate(arg, doc, now) for arg in args]
    match operator:
        case "$not":
            return not _true(values[0])
        case "$and":
            return all(_true(v) for v in values)
        case "$or":
            return any(_true(v) for v in values)
        case "$gt":
            return _order(values[0]) > _order(values[1])
        case "$eq":
            return _order(values[0]) == _order(values[1])
        case "$ne":
            return _order(values[0]) != _order(values[1])
        case "$type":
            return _type(values[0])
        case "$ifNull":
            return values[1] if values[0] is MISSING or values[0] is None else values[0]
        case "$max":
            return max((v for v in values if v is not MISSING and v is not None), key=_order)
        case "$add":
            return _add(values)
        case "$multiply":
            product = 1
            for v in values:
                product *= v
            return product
        case "$toLong":
            (value,) = values
            if isinstance(value, datetime.datetime):
                return (value - _EPOCH) // datetime.timedelta(milliseconds=1)
            return int(value)
    raise NotImplementedError(f"operator {operator} is not known here")


def run_pipeline(
    doc: Mapping[str, Any], pipeline: list[dict[str, Any]], now: datetime.datetime
) -> dict[str, Any]:
    """``doc`` after an update pipeline of ``$set`` and ``$unset`` stages."""
    current = dict(doc)
    for stage in pipeline:
        ((name, spec),) = stage.items()
        if name == "$set":
            values = {field: evaluate(value, current, now) for field, value in spec.items()}
            current.update(values)
            for field, value in values.items():
                if value is MISSING:
                    del current[field]
        elif name == "$unset":
            for field in [spec] if isinstance(spec, str) else spec:
                current.pop(field, None)
        else:
            raise NotImplementedError(f"stage {name} is not known here")
    return current


def run_update(
    doc: Mapping[str, Any], update: Mapping[str, Any], now: datetime.datetime
) -> dict[str, Any]:
    """``doc`` after an update document of ``$unset`` and ``$currentDate``."""
    current = dict(doc)
    for name, spec in update.items():
        if name == "$unset":
            for field in spec:
                current.pop(field, None)
        elif name == "$currentDate":
            for field, kind in spec.items():
                if kind is not True:
                    raise NotImplementedError(f"$currentDate {kind!r}")
                current[field] = now
        else:
            raise NotImplementedError(f"update operator {name} is not known here")
    return current


def matches(doc: Mapping[str, Any], query: Mapping[str, Any], now: datetime.datetime) -> bool:
    """Whether ``doc`` matches a query filter (equality, ``$exists``, ``$regex``, ``$expr``)."""
    for name, condition in query.items():
        if name == "$expr":
            if not _true(evaluate(condition, doc, now)):
                return False
            continue
        value = doc.get(name, MISSING)
        if isinstance(condition, dict):
            for operator, argument in condition.items():
                if operator == "$exists":
                    if (value is not MISSING) != bool(argument):
                        return False
                elif operator == "$regex":
                    if not isinstance(value, str) or not re.search(argument, value):
                        return False
                else:
                    raise NotImplementedError(f"query operator {operator} is not known here")
        elif value is MISSING or value != condition:
            return False
    return True
