//! [`Slab`]: a bucket's item records in fixed-size chunks.
//!
//! A plain `Vec` would reallocate as a bucket grows, and every reallocation leaves the old
//! block free but still resident (about one old slab per bucket: tens of bytes per item at a
//! million items). Chunks never move: growing allocates one more chunk, and at most one
//! partly used chunk per bucket is slack.

use super::item::Item;

/// Records per chunk (40-byte records: 2.5 KiB chunks).
const CHUNK: usize = 64;

/// Items addressed by position `0..len`, dense: removing one moves the last into its place.
#[derive(Debug, Default)]
pub struct Slab {
    chunks: Vec<Vec<Item>>,
    len: usize,
}

impl Slab {
    /// Number of items.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no item.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The item at `pos`.
    pub fn get(&self, pos: usize) -> Option<&Item> {
        self.chunks.get(pos / CHUNK).and_then(|c| c.get(pos % CHUNK))
    }

    /// Replaces the item at `pos`, returning the old one.
    pub fn replace(&mut self, pos: usize, item: Item) -> Item {
        std::mem::replace(&mut self.chunks[pos / CHUNK][pos % CHUNK], item)
    }

    /// Appends an item at position `len`.
    pub fn push(&mut self, item: Item) {
        if self.chunks.last().is_none_or(|c| c.len() == CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        if let Some(last) = self.chunks.last_mut() {
            last.push(item);
        }
        self.len += 1;
    }

    /// Removes the item at `pos`; the last item takes its place. `pos < len`.
    pub fn swap_remove(&mut self, pos: usize) -> Item {
        let last_chunk = self.chunks.len() - 1;
        let mut last = self.chunks[last_chunk].pop().expect("a non-empty slab has a non-empty last chunk");
        if self.chunks[last_chunk].is_empty() {
            self.chunks.pop();
        }
        self.len -= 1;
        if pos == self.len {
            return last;
        }
        std::mem::swap(&mut self.chunks[pos / CHUNK][pos % CHUNK], &mut last);
        last
    }

    /// Every item, in position order.
    pub fn iter(&self) -> impl Iterator<Item = &Item> {
        self.chunks.iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(n: u32) -> Item {
        Item::new(&n.to_be_bytes(), b"", u64::from(n), 0, 0, None)
    }

    #[test]
    fn positions_stay_dense_through_pushes_and_removes() {
        let mut slab = Slab::default();
        let mut model: Vec<u64> = Vec::new();
        for n in 0..300 {
            slab.push(item(n));
            model.push(u64::from(n));
        }
        for pos in [0, 150, 297, 64, 63, 127, 5] {
            let removed = slab.swap_remove(pos);
            assert_eq!(removed.version(), model.swap_remove(pos));
        }
        assert_eq!(slab.len(), model.len());
        let versions: Vec<u64> = slab.iter().map(Item::version).collect();
        assert_eq!(versions, model);
        assert_eq!(slab.get(model.len()).map(Item::version), None);
        while !slab.is_empty() {
            slab.swap_remove(0);
        }
        assert!(slab.chunks.is_empty(), "empty chunks are freed");
    }
}
