//! A linearizability checker for one key, a register that holds a value or nothing: the
//! Wing–Gong search with Lowe's memo of configurations already tried (as Porcupine does).
//!
//! An operation takes effect at one instant between its call and its answer. The history of a
//! key is linearizable when its operations can be put in one order that respects real time (an
//! operation answered before another was called comes first) and in which every read sees what
//! the write before it left. The search linearizes, one at a time, an operation that no pending
//! one must precede; it backtracks when a read cannot see the state, and remembers each
//! (operations done, state) it gave up on, so it never explores one twice.
//!
//! A write with no definite answer may take effect at any time after its call, or never: it
//! has no answer time and need not be linearized at all.

use std::collections::HashSet;
use std::time::Duration;

/// The state of a key: a value, or nothing.
pub type State = Option<String>;

/// What an operation did to the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// It left this state.
    Write(State),
    /// It saw this state.
    Read(State),
}

/// One operation of a key's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// When it was called.
    pub call: Duration,
    /// When it was answered; `None`: no definite answer (a write that may land any time after
    /// its call, or never).
    pub answer: Option<Duration>,
    /// What it did.
    pub action: Action,
}

/// What the search found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// An order exists.
    Linearizable,
    /// None does.
    Not,
    /// The search gave up after this many configurations.
    Undecided(usize),
}

/// The most configurations one search explores before it gives up.
pub const BUDGET: usize = 2_000_000;

/// Whether `history` (of one key, from nothing) is linearizable, exploring at most `budget`
/// configurations.
pub fn check(history: &[Entry], budget: usize) -> Verdict {
    // A write with no answer whose value no read saw changes nothing the history shows if it
    // lands last, which it may: it is left out (it only widens the search).
    let seen: HashSet<&State> =
        history.iter().filter_map(|e| if let Action::Read(s) = &e.action { Some(s) } else { None }).collect();
    let entries: Vec<&Entry> = history
        .iter()
        .filter(|e| e.answer.is_some() || matches!(&e.action, Action::Write(s) if seen.contains(s)))
        .collect();
    // A read of a value no write left: no order explains it (found at once, not by search).
    let written: HashSet<&State> =
        history.iter().filter_map(|e| if let Action::Write(s) = &e.action { Some(s) } else { None }).collect();
    if seen.iter().any(|s| s.is_some() && !written.contains(s)) {
        return Verdict::Not;
    }
    let mut search = Search { entries, memo: HashSet::new(), budget, explored: 0 };
    let mut done = vec![0u64; search.entries.len().div_ceil(64)];
    let must = search.entries.iter().filter(|e| e.answer.is_some()).count();
    match search.from(&mut done, None, must) {
        Some(true) => Verdict::Linearizable,
        Some(false) => Verdict::Not,
        None => Verdict::Undecided(search.explored),
    }
}

struct Search<'a> {
    entries: Vec<&'a Entry>,
    /// (operations done, state) already explored without success.
    memo: HashSet<(Vec<u64>, State)>,
    budget: usize,
    explored: usize,
}

fn is_set(bits: &[u64], i: usize) -> bool {
    bits[i / 64] & (1 << (i % 64)) != 0
}

fn flip(bits: &mut [u64], i: usize) {
    bits[i / 64] ^= 1 << (i % 64);
}

impl Search<'_> {
    /// Whether the operations not in `done` can be linearized from `state` (`must`: how many
    /// of them have an answer); `None` once the budget is spent.
    fn from(&mut self, done: &mut Vec<u64>, state: State, must: usize) -> Option<bool> {
        if must == 0 {
            return Some(true);
        }
        if !self.memo.insert((done.clone(), state.clone())) {
            return Some(false);
        }
        self.explored += 1;
        if self.explored > self.budget {
            return None;
        }
        // An operation answered before another was called precedes it: only one called no
        // later than the first answer of those pending may be next.
        let pending = || (0..self.entries.len()).filter(|&i| !is_set(done, i));
        let horizon = pending().filter_map(|i| self.entries[i].answer).min().unwrap_or(Duration::MAX);
        let mut next: Vec<usize> = pending().filter(|&i| self.entries[i].call <= horizon).collect();
        // Reads that can see the state first, then writes by answer (those without last): the
        // order only decides how soon an answer is found.
        next.sort_by_key(|&i| {
            let e = self.entries[i];
            (matches!(e.action, Action::Write(_)), e.answer.unwrap_or(Duration::MAX))
        });
        for i in next {
            let entry = self.entries[i];
            let after = match &entry.action {
                Action::Read(s) if *s != state => continue,
                Action::Read(_) => state.clone(),
                Action::Write(s) => s.clone(),
            };
            flip(done, i);
            let found = self.from(done, after, must - usize::from(entry.answer.is_some()));
            flip(done, i);
            if found != Some(false) {
                return found;
            }
        }
        Some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(t: u64) -> Duration {
        Duration::from_millis(t)
    }

    fn v(s: &str) -> State {
        Some(s.to_string())
    }

    fn write(call: u64, answer: u64, s: State) -> Entry {
        Entry { call: ms(call), answer: Some(ms(answer)), action: Action::Write(s) }
    }

    fn unanswered(call: u64, s: State) -> Entry {
        Entry { call: ms(call), answer: None, action: Action::Write(s) }
    }

    fn read(call: u64, answer: u64, s: State) -> Entry {
        Entry { call: ms(call), answer: Some(ms(answer)), action: Action::Read(s) }
    }

    fn verdict(h: &[Entry]) -> Verdict {
        check(h, BUDGET)
    }

    #[test]
    fn sequential_histories_are_linearizable_exactly_when_each_read_sees_the_last_write() {
        assert_eq!(verdict(&[]), Verdict::Linearizable);
        assert_eq!(verdict(&[read(0, 1, None)]), Verdict::Linearizable);
        assert_eq!(verdict(&[write(0, 1, v("a")), read(2, 3, v("a"))]), Verdict::Linearizable);
        assert_eq!(verdict(&[write(0, 1, v("a")), write(2, 3, None), read(4, 5, None)]), Verdict::Linearizable);
        assert_eq!(verdict(&[read(0, 1, v("a"))]), Verdict::Not, "a value nobody wrote");
        assert_eq!(verdict(&[write(0, 1, v("a")), read(2, 3, None)]), Verdict::Not, "a lost write");
        assert_eq!(
            verdict(&[write(0, 1, v("a")), write(2, 3, v("b")), read(4, 5, v("a"))]),
            Verdict::Not,
            "back in time"
        );
    }

    #[test]
    fn concurrent_operations_may_take_effect_in_either_order() {
        // Two writers overlap: a read after both may see either, but then only that one.
        let both = [write(0, 10, v("a")), write(2, 8, v("b"))];
        for last in ["a", "b"] {
            let mut h = both.to_vec();
            h.push(read(11, 12, v(last)));
            h.push(read(13, 14, v(last)));
            assert_eq!(verdict(&h), Verdict::Linearizable, "{last}");
        }
        let mut flapping = both.to_vec();
        flapping.extend([read(11, 12, v("a")), read(13, 14, v("b"))]);
        assert_eq!(verdict(&flapping), Verdict::Not, "no write between the reads");
        // A read overlapping a write sees before or after it.
        let h = [write(0, 1, v("a")), write(2, 10, v("b")), read(3, 4, v("a")), read(5, 6, v("b"))];
        assert_eq!(verdict(&h), Verdict::Linearizable);
        let h = [write(0, 1, v("a")), write(2, 10, v("b")), read(3, 4, v("b")), read(5, 6, v("a"))];
        assert_eq!(verdict(&h), Verdict::Not, "once a read saw b, a later one cannot see a");
        // Real time: a write answered before a read was called precedes it.
        assert_eq!(verdict(&[write(0, 1, v("a")), read(5, 6, None), write(7, 8, None)]), Verdict::Not);
    }

    #[test]
    fn a_write_without_an_answer_may_land_any_time_after_its_call_or_never() {
        assert_eq!(verdict(&[unanswered(0, v("a"))]), Verdict::Linearizable, "never");
        let h = [write(0, 1, v("a")), unanswered(2, v("b")), read(50, 51, v("a")), read(60, 61, v("b"))];
        assert_eq!(verdict(&h), Verdict::Linearizable, "late");
        let h = [write(0, 1, v("a")), unanswered(2, v("b")), read(50, 51, v("b")), read(60, 61, v("a"))];
        assert_eq!(verdict(&h), Verdict::Not, "it lands once");
        assert_eq!(verdict(&[read(0, 1, v("b")), unanswered(2, v("b"))]), Verdict::Not, "not before its call");
    }

    #[test]
    fn a_search_that_cannot_end_in_its_budget_says_so() {
        // Many overlapping writes, then reads that flap between two of them: every order of
        // the writes must be tried before the answer is no.
        let mut h: Vec<Entry> = (0..24).map(|i| write(i, 100, v(&format!("w{i}")))).collect();
        h.extend([read(101, 102, v("w0")), read(103, 104, v("w1")), read(105, 106, v("w0"))]);
        assert!(matches!(check(&h, 1000), Verdict::Undecided(_)));
    }
}
