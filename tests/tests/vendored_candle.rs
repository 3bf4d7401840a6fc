//! The vendored candle-core's bf16 addition (`vendor/candle-core.patch`: an AVX-512 path with
//! the conversions inline) against `half`'s own addition, element by element and bit for bit:
//! widen both to f32, add, round to nearest even — NaN, infinities, subnormals and ties included.
//! And its backward hook (`Tensor::backward_with_hook`) against the plain backward, and its
//! exchange of two tensors' storages (`Tensor::swap_storage`) with what it refuses.

use candle_core::{Device, Tensor};
use half::bf16;

/// A deterministic spread of bf16 bit patterns: every special class, then pseudo-random ones.
fn patterns(n: usize, seed: u64) -> Vec<bf16> {
    let special = [
        0x0000u16, 0x8000, 0x0001, 0x8001, 0x007f, 0x0080, 0x3f80, 0xbf80, 0x7f7f, 0xff7f, 0x7f80, 0xff80, 0x7fc0,
        0x7f81, 0xffc1, 0x4000, 0x3f81, 0x3b80, 0x4b00,
    ];
    let mut state = seed;
    (0..n)
        .map(|i| {
            if i < special.len() {
                return bf16::from_bits(special[(i + seed as usize) % special.len()]);
            }
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let bits = (state >> 33) as u16;
            // Half of them near 1.0 in magnitude, so that sums round at ties and carry.
            if i % 2 == 0 {
                bf16::from_bits((bits & 0x807f) | 0x3f80)
            } else {
                bf16::from_bits(bits)
            }
        })
        .collect()
}

#[test]
fn bf16_addition_is_halfs_addition_bit_for_bit() {
    // Lengths around the 16-wide vector steps, so that the tail loop runs as well.
    for (len, seed) in [(1usize, 1u64), (15, 2), (16, 3), (17, 4), (4099, 5), (65_536, 6)] {
        let (a, b) = (patterns(len, seed), patterns(len, seed + 100));
        let ta = Tensor::from_vec(a.clone(), len, &Device::Cpu).unwrap();
        let tb = Tensor::from_vec(b.clone(), len, &Device::Cpu).unwrap();
        let sum = ta.add(&tb).unwrap().to_vec1::<bf16>().unwrap();
        for (i, ((x, y), s)) in a.iter().zip(&b).zip(&sum).enumerate() {
            let want = bf16::from_f32(x.to_f32() + y.to_f32());
            if want.is_nan() {
                assert!(s.is_nan(), "{x:?} + {y:?}: {s:?}, want NaN (at {i} of {len})");
            } else {
                assert_eq!(s.to_bits(), want.to_bits(), "{x:?} + {y:?}: {s:?}, want {want:?} (at {i} of {len})");
            }
        }
    }
}

/// The fourth change: `backward_with_hook` calls the hook once per variable, with its gradient
/// complete — the same as the plain backward's, even for a variable read by several ops — and
/// reaches a variable only after every op that reads it (here `b`, read last in the forward
/// pass, before `a`, which `b`'s op also depends on through `h`).
#[test]
fn the_backward_hook_sees_each_gradient_complete_once() {
    use candle_core::backprop::GradStore;
    use candle_core::{TensorId, Var};
    let dev = Device::Cpu;
    let a = Var::from_tensor(&Tensor::new(&[[1f32, -2.], [0.5, 3.]], &dev).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::new(&[[0.25f32, 1.], [-1., 2.]], &dev).unwrap()).unwrap();
    let x = Tensor::new(&[[2f32, 1.], [-1., 0.5]], &dev).unwrap();
    // `a` is read twice (a matmul and an element-wise product), `b` once, after both.
    let h = x.matmul(a.as_tensor()).unwrap().tanh().unwrap();
    let h = (h * a.as_tensor()).unwrap();
    let loss = h.matmul(b.as_tensor()).unwrap().sqr().unwrap().sum_all().unwrap();
    let plain = loss.backward().unwrap();
    let mut seen: Vec<(TensorId, Vec<f32>)> = Vec::new();
    let mut hook = |v: &Tensor, grads: &mut GradStore| {
        let g = grads.remove(v).expect("a gradient when the hook is called");
        seen.push((v.id(), g.flatten_all()?.to_vec1::<f32>()?));
        Ok(())
    };
    let rest = loss.backward_with_hook(&mut hook).unwrap();
    let order: Vec<TensorId> = seen.iter().map(|(id, _)| *id).collect();
    assert_eq!(order, vec![b.id(), a.id()], "each variable once, `b` first");
    for (var, (_, g)) in [&b, &a].into_iter().zip(&seen) {
        let want = plain.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, &want, "the hook's gradient is the complete one");
    }
    assert!(rest.get(a.as_tensor()).is_none() && rest.get(b.as_tensor()).is_none(), "the hook took them");
}

#[test]
fn swapped_storages_move_with_every_view_and_mismatches_are_refused() {
    let a = candle_core::Var::from_vec((0..12).map(|v| v as f32).collect::<Vec<_>>(), (3, 4), &Device::Cpu).unwrap();
    let view = a.as_tensor().narrow(1, 1, 2).unwrap();
    let b = Tensor::from_vec((100..112).map(|v| v as f32).collect::<Vec<_>>(), 12, &Device::Cpu).unwrap();
    a.swap_storage(&b).unwrap();
    // Each tensor reads the other's former values through its own layout; the view follows.
    assert_eq!(
        a.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        (100..112).map(|v| v as f32).collect::<Vec<_>>()
    );
    assert_eq!(b.to_vec1::<f32>().unwrap(), (0..12).map(|v| v as f32).collect::<Vec<_>>());
    assert_eq!(view.to_vec2::<f32>().unwrap(), vec![vec![101.0, 102.0], vec![105.0, 106.0], vec![109.0, 110.0]]);
    // And back: the exchange is its own inverse.
    b.swap_storage(a.as_tensor()).unwrap();
    assert_eq!(view.to_vec2::<f32>().unwrap(), vec![vec![1.0, 2.0], vec![5.0, 6.0], vec![9.0, 10.0]]);

    let shorter = Tensor::zeros(11, candle_core::DType::F32, &Device::Cpu).unwrap();
    let other_dtype = Tensor::zeros(12, candle_core::DType::BF16, &Device::Cpu).unwrap();
    // A narrowed tensor of 12 elements over a longer storage: the storages' lengths decide.
    let longer = Tensor::zeros(13, candle_core::DType::F32, &Device::Cpu).unwrap().narrow(0, 0, 12).unwrap();
    for (bad, why) in
        [(&shorter, "length"), (&other_dtype, "dtype"), (&longer, "stored length"), (&view, "shared storage")]
    {
        let e = a.swap_storage(bad).expect_err(why).to_string();
        assert!(e.contains("swap_storage"), "{why}: {e}");
    }
    // Nothing changed on a refusal.
    assert_eq!(
        a.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        (0..12).map(|v| v as f32).collect::<Vec<_>>()
    );
    assert_eq!(shorter.to_vec1::<f32>().unwrap(), vec![0.0; 11]);
}
