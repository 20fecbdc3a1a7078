//! ChunkedScanner on arbitrary bytes: never panics, never claims more bytes
//! than it was given, and gives the same verdict, end and payload whether fed
//! whole or cut where the first input byte says.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pier_http::ChunkedScanner;

fn run(input: &[u8], cuts: &[usize]) -> (Result<usize, pier_error::Kind>, bool, Vec<u8>) {
    let mut s = ChunkedScanner::new();
    let mut payload = Vec::new();
    let mut at = 0;
    let mut points = cuts.to_vec();
    points.push(input.len());
    for p in points {
        if p <= at {
            continue;
        }
        let piece = &input[at..p];
        match s.feed_data(piece, |r| payload.extend_from_slice(&piece[r])) {
            Err(k) => return (Err(k), false, payload),
            Ok(used) => {
                assert!(used <= piece.len());
                if s.is_done() {
                    return (Ok(at + used), true, payload);
                }
                assert_eq!(used, piece.len());
            }
        }
        at = p;
    }
    (Ok(input.len()), false, payload)
}

fuzz_target!(|data: &[u8]| {
    let Some((&step, input)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1);
    let cuts: Vec<usize> = (step..input.len()).step_by(step).collect();
    assert_eq!(run(input, &[]), run(input, &cuts));
});
