import pytest

from async_agent_rl.rewards import (
    REWARD_FUNCTIONS,
    compute_rewards,
    exact_match,
    extract_answer,
    f1,
    format_em,
    format_score,
    get_reward_fn,
    normalize_answer,
    retrieval_hit,
    substring_match,
    tag_count,
)

GOOD = (
    "<think> I need the city. </think>\n<search> Aldo Venmar </search>"
    "\n\n<information>Doc 1(Title: \"Aldo Venmar\") born in Zolgon.</information>\n\n"
    "<think> found it </think>\n<answer> Zolgon </answer>"
)


def test_normalize_drops_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The  Eiffel-Tower, (Paris)! ") == "eiffeltower paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_last_answer_of_the_response_is_scored():
    text = "<answer> Wrong </answer> then <answer> Zolgon </answer>"
    assert extract_answer(text) == "Zolgon"
    assert exact_match(text, ["zolgon"]) == 1.0
    assert exact_match("<answer> Zolgon </answer> <answer> no </answer>", ["Zolgon"]) == 0.0


def test_a_single_answer_counts_no_two_match_quirk():
    # Search-R1's qa_em needs two matches because it counts the prompt's example; we score the response only.
    assert exact_match("<answer>Zolgon</answer>", ["Zolgon"]) == 1.0


def test_no_answer_tag_scores_zero_even_if_text_is_right():
    assert exact_match("Zolgon", ["Zolgon"]) == 0.0
    assert f1("Zolgon", ["Zolgon"]) == 0.0
    assert substring_match("Zolgon", ["Zolgon"]) == 0.0


def test_exact_match_any_gold_after_normalization():
    assert exact_match("<answer> the Kal Mark. </answer>", ["Guth dinar", "kal mark"]) == 1.0
    assert exact_match("<answer> kal marks </answer>", ["kal mark"]) == 0.0


def test_substring_match():
    assert substring_match("<answer> city of Zolgon, north </answer>", ["Zolgon"]) == 1.0
    assert substring_match("<answer> Zol </answer>", ["Zolgon"]) == 0.0


def test_token_f1():
    # pred tokens: [new, zolgon, city], gold: [zolgon, city]; overlap 2 -> P=2/3, R=1 -> F1=0.8
    assert f1("<answer> New Zolgon City </answer>", ["Zolgon City"]) == pytest.approx(0.8)
    assert f1("<answer> x </answer>", ["Zolgon City", "x"]) == pytest.approx(1.0)


def test_format_rule():
    assert format_score(GOOD, []) == 1.0
    assert format_score("<answer> a </answer>", []) == 1.0  # answering directly is well formed
    assert format_score("<search> q </search><answer> a </answer>", []) == 0.0  # search without information
    assert format_score("<think> a <answer> b </answer> </think>", []) == 0.0  # nested
    assert format_score("<think> x </think>", []) == 0.0  # no answer
    assert format_score(GOOD + "<answer> again </answer>", []) == 0.0  # two answers


def test_format_em_partial_credit():
    assert format_em(GOOD, ["Zolgon"]) == 1.0
    assert format_em(GOOD, ["Other"]) == pytest.approx(0.2)
    assert format_em("<search> q </search><answer> Zolgon </answer>", ["Zolgon"]) == pytest.approx(0.8)
    assert format_em("nothing", ["Zolgon"]) == 0.0


def test_tag_count_and_retrieval_hit():
    assert tag_count(GOOD, []) == 1.0
    assert tag_count("<answer> a </answer> trailing", []) == 0.5
    assert retrieval_hit(GOOD, ["Zolgon"], retrieved_texts=["... born in Zolgon."]) == 1.0
    assert retrieval_hit(GOOD, ["Zolgon"], retrieved_texts=["Zolgonia is a country"]) == 0.0


def test_weighted_sum_and_registry():
    total, parts = compute_rewards([("exact_match", 1.0), ("format", 0.5)], GOOD, ["Zolgon"])
    assert parts == {"exact_match": 1.0, "format": 1.0} and total == 1.5
    assert set(REWARD_FUNCTIONS) >= {"exact_match", "substring_match", "f1", "format", "tag_count", "retrieval_hit"}
    with pytest.raises(KeyError, match="allowed"):
        get_reward_fn("nope")
