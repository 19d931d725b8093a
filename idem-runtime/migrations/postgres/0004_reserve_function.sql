-- idem: the reservation's write path as a function, so that the statement
-- that reserves a key reads first and writes only when it finds nothing to
-- answer: a replay or a conflict is then one primary-key lookup. The line
-- below is replaced by the function's definition, generated with the
-- statements of this build.
{reserve_function}
